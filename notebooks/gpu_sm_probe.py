"""Is the qkv-like decode matmul bound per SM? Time at K=4096, 8 rows, with the norm prologue, for
N of 64, 96, 128 and 132 column tiles (one block per tile, one block per SM)."""
import json, os
import jax, jax.numpy as jnp, numpy as np
from atlasjax.bench_kernels_quant import device_ms, rotated, MIN_ROTATION_BYTES
from atlasjax.quantization import quantize
from pallas_kernels.decode_matmul import decode_matmul, QUANT_CONFIG, DecodeMatmulConfig
rng = np.random.default_rng(0)
k, m = 4096, 8
x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
g = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
out = {}
for fmt in ("fp8", "bf16"):
    cfg = QUANT_CONFIG if fmt == "fp8" else DecodeMatmulConfig(tile_k=128, max_concurrent_steps=4)
    for tiles in (64, 96, 128, 132):
        n = 64 * tiles
        w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.bfloat16)
        w = quantize(w.astype(jnp.float32), "fp8") if fmt == "fp8" else w
        nbytes = k * n * (1 if fmt == "fp8" else 2)
        copies = max(2, -(-MIN_ROTATION_BYTES // nbytes))
        ws = [jax.tree.map(lambda a: a + 0 if a.dtype != jnp.float8_e4m3fn else a.copy(), w) for _ in range(copies)]
        fn = lambda x, w: decode_matmul(x, w, norm_scale=g, config=cfg)
        us = device_ms(rotated(fn), x, ws) / copies * 1e3
        out[f"{fmt}/{tiles}"] = {"us": round(us, 2), "TB/s": round(nbytes / us / 1e6, 3), "KB_per_block": nbytes // tiles // 1024}
        print(fmt, tiles, out[f"{fmt}/{tiles}"], flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/sm_probe.json", "w"), indent=1)

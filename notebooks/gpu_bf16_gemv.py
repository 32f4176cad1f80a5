"""GPU: how close the Mosaic GPU decode matmul gets to XLA's GEMM on plain bf16 weights.

The question behind it: a matmul kernel of our own could take the RMSNorm before it and the
residual add after it (two kernels per projection fewer), but only pays if its streaming is
about as fast as XLA's GEMM. The fused dequantize kernel (pallas_kernels/quantized_matmul.py)
runs a bf16 weight unchanged (its per-channel path with unit scales), so this times it against
XLA's dot on the Llama-3.1-8B decode shapes, 8 rows, with CUPTI, weights rotated past the L2.

  JAX_PLATFORMS=cuda PYTHONPATH=. [SHAPES=4096x4096,4096x6144] python notebooks/gpu_bf16_gemv.py
  -> $OUT/bf16_gemv.json (SHAPES: K x N; default the four 8B decode shapes)
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import DECODE_SHAPES, copy_bandwidth, device_ms, rotated
from pallas_kernels.quant_format import QuantizedWeight
from pallas_kernels.quantized_matmul import QuantMatmulConfig, quantized_matmul

OUT = os.environ.get("OUT", "/tmp")
ROWS = 8
CONFIGS = {
    "k128_d4": QuantMatmulConfig(tile_k=128, max_concurrent_steps=4),
    "k128_d6": QuantMatmulConfig(tile_k=128, max_concurrent_steps=6),
    "k256_d4": QuantMatmulConfig(tile_k=256, max_concurrent_steps=4),
    "k128_d6_nosplit": QuantMatmulConfig(tile_k=128, max_concurrent_steps=6, num_k_splits=1),
    # K split in 8: each block streams 512 rows of K, the slice one KV head's attention output
    # meets in o_proj (the streaming of a fused decode attention + o_proj kernel)
    "k128_d4_split8": QuantMatmulConfig(tile_k=128, max_concurrent_steps=4, num_k_splits=8),
}
SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ["SHAPES"].split(",")] if os.environ.get("SHAPES") \
    else DECODE_SHAPES

res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": ROWS, "shapes": []}
copy_bps = copy_bandwidth()
res["copy_TBps"] = copy_bps / 1e12
for k, n in SHAPES:
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((ROWS, k), np.float32), jnp.bfloat16)
    copies = max(2, -(-(256 << 20) // w.nbytes))
    ws = [w + i for i in range(copies)]
    wts = [jnp.asarray(v.T) for v in ws]
    row = {"K": k, "N": n, "bytes": w.nbytes}
    row["xla_KN_us"] = device_ms(rotated(lambda x, w: x @ w), x, ws) / copies * 1e3
    row["xla_NK_us"] = device_ms(rotated(lambda x, wt: jax.lax.dot_general(
        x, wt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)), x, wts) / copies * 1e3
    ref = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32))
    for name, cfg in CONFIGS.items():
        qws = [QuantizedWeight(qweight=wt, scales=jnp.ones((1, n), jnp.float32), zeros=None,
                               format="bf16", group_size=k, shape=(k, n)) for wt in wts]
        fn = lambda x, qw, cfg=cfg: quantized_matmul(x, qw, backend="pallas", config=cfg)
        try:
            y = np.asarray(fn(x, qws[0]), np.float32)
            row[f"{name}_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
            row[f"{name}_us"] = device_ms(rotated(fn), x, qws) / copies * 1e3
        except Exception as e:  # noqa: BLE001 - record and go on
            row[f"{name}_error"] = repr(e)[:300]
    for key in [k_ for k_ in row if k_.endswith("_us")]:
        row[key.replace("_us", "_copy_frac")] = w.nbytes / (row[key] * 1e-6) / copy_bps
    res["shapes"].append(row)
    print(json.dumps(row), flush=True)
    with open(f"{OUT}/bf16_gemv.json", "w") as f:
        json.dump(res, f, indent=1)

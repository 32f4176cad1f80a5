"""GPU: is the qkv-shaped decode matmul bound per block? (session 31)

qkv's 96 column tiles run 96 blocks on the H100's 132 SMs, one block per SM (quantized weights pad
their shared memory to keep a second block off). MODE=tiles times the kernel with the RMSNorm
prologue at K=4096, 8 rows, for 64-132 tiles at the same bytes per block. MODE=split times qkv
(4096 x 6144) with its K split over 2-block clusters, with and without the padding, with the
norm in the kernel or computed before it by XLA (both timed). MODE=grid times fp8 qkv on the fused
dequantize kernel (pallas_kernels/quantized_matmul.py, several blocks per SM) with K split over its
grid and the partials summed by XLA, against XLA's GEMM and the decode matmul, the norm by XLA.

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks [MODE=tiles|split|grid] python notebooks/gpu_sm_probe.py   # -> $OUT/sm_probe_<mode>.json
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, device_ms, rotated
from atlasjax.quantization import quantize
from models.deferred import rms_norm
from pallas_kernels import decode_matmul as dm
from pallas_kernels.decode_matmul import decode_matmul, decode_matmul_reference
from pallas_kernels.decode_matmul_rules import QUANT_CONFIG, DecodeMatmulConfig
from pallas_kernels.quantized_matmul import QuantMatmulConfig, quantized_matmul

MODE = os.environ.get("MODE", "tiles")
OUT = os.environ.get("OUT", "/tmp")
K, M = 4096, 8
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
g = jnp.asarray(1 + 0.1 * rng.standard_normal(K), jnp.bfloat16)
results = {"device": jax.devices()[0].device_kind, "mode": MODE}


def weights(fmt, n):
    w = jnp.asarray(rng.standard_normal((K, n)) * 0.02, jnp.bfloat16)
    w = quantize(w.astype(jnp.float32), "fp8") if fmt == "fp8" else w
    nbytes = K * n * (1 if fmt == "fp8" else 2)
    copies = max(2, -(-MIN_ROTATION_BYTES // nbytes))
    return w, [jax.tree.map(jnp.copy, w) for _ in range(copies)], nbytes


def record(name, fn, w, ws, nbytes, ref):
    dm.decode_matmul.clear_cache()
    err = float(jnp.linalg.norm(fn(x, w).astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    us = device_ms(rotated(fn), x, ws) / len(ws) * 1e3
    results[name] = {"us": round(us, 2), "TB/s": round(nbytes / us / 1e6, 3), "rel_err": err}
    print(name, results[name], flush=True)


if MODE == "tiles":
    for fmt in ("fp8", "bf16"):
        cfg = QUANT_CONFIG if fmt == "fp8" else DecodeMatmulConfig(tile_k=128, max_concurrent_steps=4)
        for tiles in (64, 96, 128, 132):
            w, ws, nbytes = weights(fmt, 64 * tiles)
            ref = decode_matmul_reference(x, w, norm_scale=g, out_dtype=jnp.float32)
            record(f"{fmt}/{tiles}", lambda x, w: decode_matmul(x, w, norm_scale=g, config=cfg), w, ws, nbytes, ref)
elif MODE == "grid":
    w, ws, nbytes = weights("fp8", 6144)
    ref = decode_matmul_reference(x, w, norm_scale=g, out_dtype=jnp.float32)
    normed = lambda x: rms_norm(x, g, 1e-6)   # noqa: E731
    record("fp8/decode_matmul", lambda x, w: decode_matmul(normed(x), w, config=QUANT_CONFIG), w, ws, nbytes, ref)
    record("fp8/xla", lambda x, w: quantized_matmul(normed(x), w, backend="xla"), w, ws, nbytes, ref)
    for tile_k in (128, 256):
        for splits in (1, 2, 4, 8):
            for depth in (4, 6):
                cfg = QuantMatmulConfig(tile_k=tile_k, num_k_splits=splits, max_concurrent_steps=depth)
                try:
                    record(f"fp8/fused_k{tile_k}_s{splits}_d{depth}",
                           lambda x, w, cfg=cfg: quantized_matmul(normed(x), w, backend="pallas", config=cfg), w, ws, nbytes, ref)
                except Exception as e:   # a config the kernel refuses
                    results[f"fp8/fused_k{tile_k}_s{splits}_d{depth}"] = {"error": str(e)[:200]}
else:
    for fmt in ("fp8", "bf16"):
        w, ws, nbytes = weights(fmt, 6144)
        ref = decode_matmul_reference(x, w, norm_scale=g, out_dtype=jnp.float32)
        base = QUANT_CONFIG if fmt == "fp8" else DecodeMatmulConfig(tile_k=128, max_concurrent_steps=4)
        split = dataclasses.replace(base, k_split=2, tile_k=256)
        for pad in (True, False):
            dm.ONE_BLOCK_PER_SM_SMEM = 120 * 1024 if pad else 0
            tag = "padded" if pad else "unpadded"
            record(f"{fmt}/norm_in_kernel/{tag}", lambda x, w: decode_matmul(x, w, norm_scale=g, config=base), w, ws, nbytes, ref)
            for name, cfg in (("whole", base), ("k_split2", split)):
                record(f"{fmt}/norm_by_xla/{name}/{tag}",
                       lambda x, w, cfg=cfg: decode_matmul(rms_norm(x, g, 1e-6), w, config=cfg), w, ws, nbytes, ref)
json.dump(results, open(f"{OUT}/sm_probe_{MODE}.json", "w"), indent=1)

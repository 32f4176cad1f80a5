"""GPU: int4 decode kernel, natural K order against mma order (session 14), and mma order's tunables.

For each Llama-3.1-8B projection shape and int4 format (groups of 128 with integer zero points,
what quantize at load makes; symmetric groups of 128; GGUF Q4_0 / Q4_1 groups of 32), the same
weight stored both ways through `backend="pallas"`: CUPTI kernel time (weights rotated past the
L2), fraction of a device-to-device copy measured in the same run, and the relative error to the
f32 reference. `SWEEP=1` instead runs mma order's kernel configs (K splits, pipeline depth, groups
per step) at 8 rows.

  [ROWS=8,1] [SWEEP=1] JAX_PLATFORMS=cuda python notebooks/gpu_int4_mma_order.py   # writes $OUT/int4_mma_order.json
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, copy_bandwidth, device_ms, rotated
from atlasjax.weights_summary import weight_nbytes
from atlasjax.quantization import dequantize, quantize
from pallas_kernels.quant_format import with_float_offsets, with_mma_order
from pallas_kernels.quantized_matmul import QuantMatmulConfig, quantized_matmul

SWEEP = os.environ.get("SWEEP") == "1"
SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096)] + ([(4096, 4096)] if SWEEP else [(4096, 128256)])
ROWS = [8] if SWEEP else [int(r) for r in os.environ.get("ROWS", "8,1").split(",")]
FORMATS = [("g128_zp", 128, False, False), ("g128_sym", 128, True, False),
           ("g32_q4_0", 32, True, False), ("g32_q4_1", 32, False, True)]   # name, group, symmetric, float offsets
CONFIGS = {"default": QuantMatmulConfig()}
if SWEEP:
    CONFIGS |= {"split2": QuantMatmulConfig(num_k_splits=2), "split4": QuantMatmulConfig(num_k_splits=4),
                "depth6": QuantMatmulConfig(max_concurrent_steps=6), "depth8": QuantMatmulConfig(max_concurrent_steps=8),
                "unroll1": QuantMatmulConfig(group_unroll=1), "unroll4": QuantMatmulConfig(group_unroll=4)}

copy = copy_bandwidth()
print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  copy {copy / 1e9:.0f} GB/s", flush=True)
results = []
for k, n in SHAPES:
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
    for m in ROWS:
        x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
        for name, group, symmetric, offsets in FORMATS:
            qw = quantize(w, "int4", group_size=group, symmetric=symmetric)
            qw = with_float_offsets(qw) if offsets else qw
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(qw)), np.float32)
            orders = [True] if SWEEP else [False, True]
            for mma in orders:
                stored = with_mma_order(qw, mma)
                copies = max(2, -(-MIN_ROTATION_BYTES // weight_nbytes(stored)))
                weights = [jax.tree.map(jnp.copy, stored) for _ in range(copies)]
                for cname, cfg in (CONFIGS.items() if group == 128 else [("default", QuantMatmulConfig())]):
                    fn = lambda x, w, cfg=cfg: quantized_matmul(x, w, backend="pallas", config=cfg)  # noqa: E731
                    y = np.asarray(jax.jit(fn)(x, stored), np.float32)
                    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    us = device_ms(rotated(fn), x, weights) / copies * 1e3
                    frac = (weight_nbytes(stored) + x.nbytes + m * n * 2) / (us * 1e-6) / copy
                    row = dict(K=k, N=n, M=m, format=name, order="mma" if mma else "natural", config=cname,
                               us=us, copy_fraction=frac, rel_err=err)
                    results.append(row)
                    print(f"{k}x{n} m={m} {name} {row['order']} {cname}: {us:.1f} us ({frac:.0%}), err {err:.1e}", flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "int4_mma_order.json"), "w") as f:
    json.dump(results, f, indent=1)

"""GPU: the int4 decode matmul (pallas_kernels/int4_decode_matmul.py, session 29) against what it
replaces in the engine: the int4 kernel of pallas_kernels/quantized_matmul.py, XLA's sum of its K
split partials with the residual add, and (qkv) XLA's RMSNorm before it. Llama-3.1-8B's int4 qkv,
o_proj, down and gate_up (groups of 128, integer zero points, as quantize at load makes them).

For each shape and row count: the median CUPTI time of each path over weight copies that rotate
past the L2 (all kernels of the path), its share of copy bandwidth, its relative-norm error against
the jnp reference, and the K splits. x is one array for all copies, so XLA computes a norm
outside the kernel once per call ("unfused", "fused_no_norm"): add a norm kernel's time (~1.6 us in
the step) to compare those with "fused".

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks [ROW_COUNTS=1,8] [SPLITS=2,4,8] \
      python notebooks/gpu_int4_decode_matmul.py      # -> $OUT/int4_decode_matmul.json
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES
from atlasjax.quantization import quantize
from gpu_bf16_smem_gemv import start, time_paths, write   # copy bandwidth, timing loop, JSON
from models.deferred import rms_norm
from pallas_kernels.int4_decode_matmul import int4_decode_matmul, int4_decode_matmul_reference, num_splits
from pallas_kernels.quantized_matmul import quantized_matmul

# name: (K, N, fusion) as the 8B layer runs them
SHAPES = {"qkv": (4096, 6144, "norm"), "o_proj": (4096, 4096, "residual"), "gate_up": (4096, 28672, "norm"),
          "down": (14336, 4096, "residual")}


def main():
    copy = start()
    rng = np.random.default_rng(0)
    results = []
    for name, (k, n, fusion) in SHAPES.items():
        qw = quantize(rng.standard_normal((k, n), np.float32) * 0.02, "int4", group_size=128)
        copies = max(2, -(-MIN_ROTATION_BYTES // qw.qweight.nbytes))
        qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]
        nbytes = qw.qweight.size // 2 + qw.scales.nbytes + qw.zeros.nbytes   # two codes per byte, group rows
        g = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
        for rows in map(int, os.environ.get("ROW_COUNTS", "1,8").split(",")):
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
            r = jnp.asarray(rng.standard_normal((rows, n), np.float32), jnp.bfloat16)
            fused = {"norm_scale": g, "norm_eps": 1e-5} if fusion == "norm" else {}
            res = r if fusion == "residual" else None
            ref = np.asarray(int4_decode_matmul_reference(x, qw, res, **fused), np.float32)
            row = dict(proj=name, K=k, N=n, rows=rows, bytes=nbytes, fusion=fusion, default_splits=num_splits(qw))

            def unfused(x, w):   # the engine's path before: XLA's norm, the int4 kernel, XLA's sum (+ residual)
                a = rms_norm(x, g, 1e-5) if fusion == "norm" else x
                y = quantized_matmul(a, w)
                return y if res is None else res + y
            kernels = {"unfused": unfused, "fused": lambda x, w: int4_decode_matmul(x, w, res, **fused)}
            for s in map(int, os.environ.get("SPLITS", "").split(",") if os.environ.get("SPLITS") else []):
                kernels[f"fused_s{s}"] = lambda x, w, s=s: int4_decode_matmul(x, w, res, splits=s, **fused)
            if fusion == "norm":
                kernels["fused_no_norm"] = lambda x, w: int4_decode_matmul(rms_norm(x, g, 1e-5), w)
            time_paths(f"{name} rows {rows} (splits {row['default_splits']})", kernels, x, qw, qws, ref, row, copy)
            results.append(row)
            write("int4_decode_matmul.json", copy, results)


if __name__ == "__main__":
    main()

"""GPU: a small target for Nsight Compute, the fused dequantize kernel alone on 8B decode shapes.

Runs `quantized_matmul(..., backend="pallas")` a few times per shape, 8 activation rows, with the
format quantize-at-load makes (int4: groups of 128, integer zero points, mma order since session
14). Profile it with

  ncu --target-processes all -k regex:quantized_matmul -c 2 --set full -o $OUT/q \
      python notebooks/gpu_ncu_quant.py
  ncu --import $OUT/q.ncu-rep --page details

`SHAPES=4096x28672,4096x6144 FMT=int4|int8|fp8` pick the weights (K x N). ncu runs the SM at its
base clock (1.44 GHz on the H100 SXM), so its durations are longer than CUPTI's at boost clock;
the instruction counts and pipe utilisations are what it is for (docs/perf_quant.md, session 13).
"""
import os

import jax
import jax.numpy as jnp

from atlasjax.quantization import quantize
from pallas_kernels.quantized_matmul import quantized_matmul

SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", "4096x28672,4096x6144").split(",")]
FMT = os.environ.get("FMT", "int4")

matmul = jax.jit(lambda x, qw: quantized_matmul(x, qw, backend="pallas"))
for k, n in SHAPES:
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
    qw = quantize(w, FMT)   # the format's default: what quantize at load makes
    x = jax.random.normal(jax.random.key(1), (8, k), jnp.bfloat16)
    for _ in range(3):
        y = matmul(x, qw).block_until_ready()
    print(f"{FMT} {k}x{n}: y {y.shape}", flush=True)

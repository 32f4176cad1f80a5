"""y = x @ W with fp8 activations and per-channel fp8 weights (W8A8): prefill on the fp8 tensor cores.

Each row of x is rounded to e4m3 with its own scale (absmax / 448, computed as the product runs:
dynamic per-token scales, as vLLM's fp8 runs); W keeps its per-output-channel e4m3 codes. The
product of the codes accumulates in f32 and both scales multiply the result. On Hopper XLA lowers
the f8 x f8 dot to cuBLASLt's fp8 GEMM (`__cublas$lt$matmul$f8`), which runs at up to twice the
bf16 rate; elsewhere it computes the same products (exact in f32) on whatever XLA has.

Measured on an H100 (docs/performance.md, session 50), us per product as W8A8 (the activations'
quantization included) / the W8A16 path the engine runs otherwise / the bf16 dot:
| rows | qkv 4096x6144 | o_proj 4096x4096 | gate_up 4096x28672 | down 14336x4096 |
|---|---|---|---|---|
| 64 | 13.8 / 13.6 / 24.0 | 13.0 / 9.4 / 19.6 | 52.0 / 49.7 / 79.6 | 34.0 / 28.8 / 49.2 |
| 128 | 19.6 / 19.3 / 27.6 | 14.2 / 13.2 / 18.7 | 57.0 / 60.5 / 82.6 | 36.1 / 34.7 / 50.6 |
| 256 | 24.5 / 27.8 / 29.9 | 16.8 / 20.3 / 22.6 | 70.2 / 121.2 / 119.4 | 43.4 / 51.7 / 52.0 |
| 2,048 | 108 / 173 / 142 | 79 / 114 / 93 | 403 / 837 / 737 | |
Up to 128 rows the product is bound by the weight's bytes, which W8A16 already halves, and
rounding x would only cost accuracy: `quantized_matmul` keeps W8A16 below `MIN_ROWS`.

Accuracy: each activation rounded to e4m3 adds a relative error of up to 2^-4 per element; on
Gaussian data the product's relative error goes from 0.027 (W8A16) to 0.038. The model-level cost
is measured as KL divergence in tests/test_fp8_activations.py and docs/quantization.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.quant_format import QuantizedWeight, is_per_channel

E4M3_MAX = 448.0
MIN_ROWS = 256   # products of at least this many rows take fp8 activations (session 50, H100)


def takes_fp8_activations(qw: QuantizedWeight, rows: int) -> bool:
    """Whether `quantized_matmul` multiplies `rows` activation rows by this weight in W8A8."""
    return qw.activations == "fp8" and is_per_channel(qw) and qw.format == "fp8" and rows >= MIN_ROWS


def per_token_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (codes [M, K] float8_e4m3fn, scales [M, 1] f32) with x ~= codes * scales. A row of
    zeros gets codes of zero (its scale is tiny, never zero)."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-30) / E4M3_MAX
    return (xf / scale).astype(jnp.float8_e4m3fn), scale


def fp8_activation_matmul(x: jax.Array, qw: QuantizedWeight, out_dtype=None) -> jax.Array:
    """y [M, N] = x [M, K] @ W for per-channel fp8 W, with x rounded per row to e4m3 first."""
    if not (is_per_channel(qw) and qw.format == "fp8"):
        raise ValueError(f"fp8 activations need per-channel fp8 weights, got {qw.format} in groups of {qw.group_size}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    k_pad, _ = qw.padded_shape
    codes, x_scale = per_token_fp8(jnp.pad(x, ((0, 0), (0, k_pad - x.shape[1]))))
    # bf16 out of the GEMM where bf16 is wanted: 10-12% faster on the H100 than f32 out, and the
    # rounding it adds (2^-9) is far below the activations' own (2^-4)
    gemm_dtype = jnp.bfloat16 if out_dtype == jnp.bfloat16 else jnp.float32
    y = lax.dot_general(codes, qw.qweight, (((1,), (1,)), ((), ())), preferred_element_type=gemm_dtype)
    return (y.astype(jnp.float32) * x_scale * qw.scales[0])[:, :qw.shape[1]].astype(out_dtype)

"""y = x @ W with 8-bit activations and per-channel 8-bit weights (W8A8): prefill on the 8-bit tensor cores.

Each row of x is rounded to the weight's format with its own scale, computed as the product runs
(dynamic per-token scales, as vLLM runs fp8 and int8 W8A8 checkpoints):
- fp8: e4m3 codes at absmax / 448; the e4m3 x e4m3 dot lowers on Hopper to cuBLASLt's fp8 GEMM
  (`__cublas$lt$matmul$f8`);
- int8: symmetric integer codes in [-127, 127] at absmax / 127; the s8 x s8 -> s32 dot is exact and
  runs on the int8 tensor cores (cuBLASLt's int8 GEMM: 1,590 TOPS at 2,048 x gate_up on the H100,
  2.4x the bf16 dot's rate), but its s32 result makes a round trip through memory before the scales
  multiply it (4 bytes read per output, 2 written), where fp8's GEMM writes bf16. An int8 weight
  stored in mma order (pallas_kernels/int8_mma_order.py) has K permuted in blocks of 32: the
  activation codes are permuted alike, which leaves the sum unchanged.
W keeps its per-output-channel codes; both scales multiply the result in f32. Elsewhere XLA
computes the same products (exact in f32 / s32) on whatever it has, so CPU tests measure what the
GPU runs.

Measured on an H100 (docs/performance.md, session 50), fp8, us per product as W8A8 (the activations'
quantization included) / the W8A16 path the engine runs otherwise / the bf16 dot:
| rows | qkv 4096x6144 | o_proj 4096x4096 | gate_up 4096x28672 | down 14336x4096 |
|---|---|---|---|---|
| 64 | 13.8 / 13.6 / 24.0 | 13.0 / 9.4 / 19.6 | 52.0 / 49.7 / 79.6 | 34.0 / 28.8 / 49.2 |
| 128 | 19.6 / 19.3 / 27.6 | 14.2 / 13.2 / 18.7 | 57.0 / 60.5 / 82.6 | 36.1 / 34.7 / 50.6 |
| 256 | 24.5 / 27.8 / 29.9 | 16.8 / 20.3 / 22.6 | 70.2 / 121.2 / 119.4 | 43.4 / 51.7 / 52.0 |
| 2,048 | 108 / 173 / 142 | 79 / 114 / 93 | 403 / 837 / 737 | |
Up to 128 rows the product is bound by the weight's bytes, which W8A16 already halves, and
rounding x would only cost accuracy: `quantized_matmul` keeps W8A16 below `MIN_ROWS`.
int8 (session 51), W8A8 / the engine's W8A16 (another call) / the bf16 dot, us:
| rows | qkv | o_proj | gate_up | down |
|---|---|---|---|---|
| 256 | 32.0 / 33.2 / 30.9 | 29.1 / 23.8 / 21.0 | 80.8 / 130.0 / 120.0 | 57.6 / 61.4 / 52.2 |
| 2,048 | 122 / 200 / 140 | 89 / 138 / 91 | 442 / 857 / 726 | 231 / 418 / 305 |
Of gate_up's 442 us at 2,048 rows the GEMM is 302, the s32 result's pass through the scales ~130.

Accuracy: an activation rounded to e4m3 carries a relative error of up to 2^-4, one rounded to int8
an absolute error of up to absmax / 254 (finer than e4m3 for values near the row's largest, coarser
for small ones). On Gaussian data the product's relative error goes from 0.027 (fp8 W8A16) to 0.038.
The model-level cost is measured as KL divergence in tests/test_w8a8.py and docs/quantization.md
(SmolLM2: fp8 0.0174 nats per position against 0.0114 with W8A16; int8 0.0078 against 0.0017 with
the smoothing the engine applies when it quantizes to int8 for int8 activations, atlasjax/smoothing.py,
0.0237 without).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.quant_format import QuantizedWeight, is_per_channel, permuted_like_mma_order

FORMATS = ("fp8", "int8")   # activation formats, each for weights of the same format
E4M3_MAX = 448.0
INT8_MAX = 127.0
MIN_ROWS = 256   # products of at least this many rows take 8-bit activations (session 50, H100)


def takes_quantized_activations(qw: QuantizedWeight, rows: int) -> bool:
    """Whether `quantized_matmul` multiplies `rows` activation rows by this weight in W8A8."""
    return qw.activations in FORMATS and qw.format == qw.activations and is_per_channel(qw) and rows >= MIN_ROWS


def _row_scales(xf: jax.Array, code_max: float) -> jax.Array:
    return jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-30) / code_max


def per_token_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (codes [M, K] float8_e4m3fn, scales [M, 1] f32) with x ~= codes * scales. A row of
    zeros gets codes of zero (its scale is tiny, never zero)."""
    xf = x.astype(jnp.float32)
    scale = _row_scales(xf, E4M3_MAX)
    return (xf / scale).astype(jnp.float8_e4m3fn), scale


def per_token_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (codes [M, K] int8 in [-127, 127], scales [M, 1] f32) with x ~= codes * scales,
    rounded to nearest (ties to even)."""
    xf = x.astype(jnp.float32)
    scale = _row_scales(xf, INT8_MAX)
    return jnp.clip(jnp.round(xf / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def w8a8_matmul(x: jax.Array, qw: QuantizedWeight, out_dtype=None) -> jax.Array:
    """y [M, N] = x [M, K] @ W for per-channel fp8 / int8 W, with x rounded per row to W's format first."""
    if not (is_per_channel(qw) and qw.format in FORMATS):
        raise ValueError("8-bit activations need per-channel fp8 or int8 weights, got "
                         f"{qw.format} in groups of {qw.group_size}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    k_pad, _ = qw.padded_shape
    x = jnp.pad(x, ((0, 0), (0, k_pad - x.shape[1])))
    if qw.format == "fp8":
        codes, x_scale = per_token_fp8(x)
        # bf16 out of the GEMM where bf16 is wanted: 10-12% faster on the H100 than f32 out, and the
        # rounding it adds (2^-9) is far below the activations' own (2^-4)
        gemm_dtype = jnp.bfloat16 if out_dtype == jnp.bfloat16 else jnp.float32
    else:
        codes, x_scale = per_token_int8(x)
        codes, qw = permuted_like_mma_order(codes, qw)
        gemm_dtype = jnp.int32   # exact: |sum| <= K * 127^2 < 2^31 for K < 133,000
    y = lax.dot_general(codes, qw.qweight, (((1,), (1,)), ((), ())), preferred_element_type=gemm_dtype)
    if qw.format == "int8":
        # XLA's GEMM fusion would otherwise keep the s32 -> f32 convert for itself and, running cuBLAS's
        # int8 GEMM, leave it as a kernel of its own: an f32 copy of y written and read again (2,048 x
        # gate_up: 600 against 441 us on the H100, notebooks/gpu_int8_gemm_probe.py, session 51)
        y = lax.optimization_barrier(y)
    return (y.astype(jnp.float32) * x_scale * qw.scales[0])[:, :qw.shape[1]].astype(out_dtype)

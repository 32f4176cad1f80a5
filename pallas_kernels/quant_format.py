"""The `QuantizedWeight` pytree and its exact meaning (`dequantize`), shared by the kernels.

Layout and dequantization rules are documented in atlasjax/quantization.py, which creates these
(quantize at load, GGUF blocks); this module sits below it so kernels need not import the engine.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["qweight", "scales", "zeros"],
    meta_fields=["format", "group_size", "shape", "zero_point", "mma_order"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """One quantized matrix, logically W[K, N] (see the module docstring for the layout).

    Attributes:
      qweight: [N_pad, K_pad] int8 | float8_e4m3fn | int4.
      scales: [K_pad // group_size, N_pad] float32 (per channel) or float16 (groups: quantized at
        load, or GGUF's own); always multiplied in float32.
      zeros: [K_pad // group_size, N_pad] (a float dtype) or None ("int4" asymmetric only): additive
        offsets, w = (q + 8) s + zeros (GGUF Q4_1), or, with `zero_point`, integer zero points
        z in [-8, 7], w = (q - z) s (quantize at load).
      format: "int8" | "fp8" | "int4" (static).
      group_size: K-group size; per-channel formats use group_size = K_pad (static).
      shape: logical (K, N) (static).
      zero_point: how `zeros` is read (static).
      mma_order: "int4" only (static): each 32-element block of a qweight row is stored in the
        order the kernel's matrix instruction consumes it (`to_mma_order`), so that one 32-bit load
        gives a thread the eight values it needs. `dequantize` undoes it.
    """

    qweight: jax.Array
    scales: jax.Array
    zeros: jax.Array | None
    format: str
    group_size: int
    shape: tuple[int, int]
    zero_point: bool = False
    mma_order: bool = False

    @property
    def padded_shape(self) -> tuple[int, int]:
        """(K_pad, N_pad) of the stored arrays."""
        n_pad, k_pad = self.qweight.shape
        return k_pad, n_pad

    @property
    def num_groups(self) -> int:
        return self.scales.shape[-2]


# An "mma order" int4 row: each block of 32 K positions is stored as [t, b, q] (4 x 2 x 4) where the
# natural order is [q, t, b]: stored position 8t + 4b + q holds logical column 8q + 2t + b. Thread t
# of a row's quad holds, in wgmma's A-fragment layout, the column pairs 8q + 2t + {0, 1} of each
# 8-column slice q, i.e. exactly stored positions 8t .. 8t + 7: one 32-bit word, whose nibbles
# q and q + 4 are the pair of slice q (pallas_kernels/int4_mma_order.py converts them).
MMA_BLOCK = 32


def to_mma_order(q):
    """[..., K] (K a multiple of 32) natural order -> mma order. numpy or jax arrays."""
    *lead, k = q.shape
    blocks = q.reshape(*lead, k // MMA_BLOCK, 4, 4, 2)  # [.., block, q, t, b]
    n = blocks.ndim
    return blocks.transpose(*range(n - 4), n - 4, n - 2, n - 1, n - 3).reshape(q.shape)


def from_mma_order(q):
    """Inverse of `to_mma_order`."""
    *lead, k = q.shape
    blocks = q.reshape(*lead, k // MMA_BLOCK, 4, 2, 4)  # [.., block, t, b, q]
    n = blocks.ndim
    return blocks.transpose(*range(n - 4), n - 4, n - 1, n - 3, n - 2).reshape(q.shape)


def with_mma_order(qw: QuantizedWeight, mma_order: bool = True) -> QuantizedWeight:
    """The same weight with its qweight stored in (or out of) mma order. Only int4 weights whose
    K_pad is a multiple of 32 take it; others are returned as they are."""
    if qw.mma_order == mma_order or qw.format != "int4" or qw.qweight.shape[-1] % MMA_BLOCK:
        return qw
    convert = to_mma_order if mma_order else from_mma_order
    return dataclasses.replace(qw, qweight=convert(qw.qweight), mma_order=mma_order)


def with_float_offsets(qw: QuantizedWeight) -> QuantizedWeight:
    """The weight with its integer zero points rewritten as float offsets, stored like the scales
    (GGUF Q4_1's form): (q + 8) s + zeros' = (q - z) s for zeros' = -(z + 8) s, up to the rounding
    of zeros' to the scales' dtype."""
    if not qw.zero_point:
        return qw
    s, z = qw.scales.astype(jnp.float32), qw.zeros.astype(jnp.float32)
    return dataclasses.replace(qw, zeros=(-(z + 8.0) * s).astype(qw.scales.dtype), zero_point=False)


def group_offsets(qw: QuantizedWeight) -> jax.Array:
    """[G, N_pad] float32 b such that w = q * s + b for an asymmetric weight (either kind of zeros)."""
    s, z = qw.scales.astype(jnp.float32), qw.zeros.astype(jnp.float32)
    return -z * s if qw.zero_point else 8.0 * s + z


def codes_as_bf16(q):
    """int8 / int4 / e4m3 codes as bf16, exactly (all are bf16 values), in jnp or inside a Mosaic GPU
    kernel: sm_90 has no e4m3 -> bf16 conversion, e4m3 -> f16 is exact."""
    if q.dtype == jnp.float8_e4m3fn:
        q = q.astype(jnp.float16)
    return q.astype(jnp.bfloat16)


def dequantize(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The logical weight W[K, N] in `dtype` (computed in float32)."""
    k, n = qw.shape
    k_pad, n_pad = qw.padded_shape
    g = qw.group_size
    q = from_mma_order(qw.qweight) if qw.mma_order else qw.qweight
    q = q.T.astype(jnp.float32).reshape(k_pad // g, g, n_pad)  # [G, g, N_pad]
    s = qw.scales.astype(jnp.float32)[:, None, :]
    z = None if qw.zeros is None else qw.zeros.astype(jnp.float32)[:, None, :]
    if z is not None and qw.zero_point:
        w = (q - z) * s
    elif z is not None:
        w = (q + 8.0) * s + z
    else:
        w = q * s
    return w.reshape(k_pad, n_pad)[:k, :n].astype(dtype)

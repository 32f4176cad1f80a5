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
    meta_fields=["format", "group_size", "shape", "zero_point"],
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
    """

    qweight: jax.Array
    scales: jax.Array
    zeros: jax.Array | None
    format: str
    group_size: int
    shape: tuple[int, int]
    zero_point: bool = False

    @property
    def padded_shape(self) -> tuple[int, int]:
        """(K_pad, N_pad) of the stored arrays."""
        n_pad, k_pad = self.qweight.shape
        return k_pad, n_pad

    @property
    def num_groups(self) -> int:
        return self.scales.shape[-2]


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


def dequantize(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The logical weight W[K, N] in `dtype` (computed in float32)."""
    k, n = qw.shape
    k_pad, n_pad = qw.padded_shape
    g = qw.group_size
    q = qw.qweight.T.astype(jnp.float32).reshape(k_pad // g, g, n_pad)  # [G, g, N_pad]
    s = qw.scales.astype(jnp.float32)[:, None, :]
    z = None if qw.zeros is None else qw.zeros.astype(jnp.float32)[:, None, :]
    if z is not None and qw.zero_point:
        w = (q - z) * s
    elif z is not None:
        w = (q + 8.0) * s + z
    else:
        w = q * s
    return w.reshape(k_pad, n_pad)[:k, :n].astype(dtype)

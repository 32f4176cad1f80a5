"""The `QuantizedWeight` pytree and its exact meaning (`dequantize`), shared by the kernels.

Layout and dequantization rules are documented in atlasjax/quantization.py, which creates these
(quantize at load, GGUF blocks); this module sits below it so kernels need not import the engine.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.words import from_words


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["qweight", "scales", "zeros", "super_scales", "super_zeros"],
    meta_fields=["format", "group_size", "shape", "zero_point", "mma_order", "activations"],
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
      mma_order: int4 and per-channel int8 (static): each 32-element block of a qweight row is
        stored in the order the kernel's matrix instruction consumes it (`to_mma_order`), so that
        one 32-bit (int4) or 64-bit (int8) load gives a thread the eight values it needs.
        `dequantize` undoes it.
      activations: how products of many rows take their activations (static): "bf16" (W8A16 /
        W4A16), or the weight's own format for per-channel fp8 / int8 weights (W8A8: each row of x
        rounded to e4m3 / int8 with its own scale past `w8a8.MIN_ROWS` rows, on the 8-bit tensor
        cores; pallas_kernels/w8a8.py).
        A runtime choice (`--activation-quantization`), not stored in saved checkpoints.
      super_scales, super_zeros: None, or two-level group rows (GGUF K-quants): `scales` (and
        `zeros`) then hold uint8 codes, and [K_pad // super_group, N_pad] float16 rows scale them:
        a group's scale is scales[g, n] * super_scales[g // r, n] (r groups per super-group), its
        offset zeros[g, n] * super_zeros[g // r, n]. Float offsets only (not zero points).
    """

    qweight: jax.Array
    scales: jax.Array
    zeros: jax.Array | None
    format: str
    group_size: int
    shape: tuple[int, int]
    zero_point: bool = False
    mma_order: bool = False
    super_scales: jax.Array | None = None
    super_zeros: jax.Array | None = None
    activations: str = "bf16"

    @property
    def padded_shape(self) -> tuple[int, int]:
        """(K_pad, N_pad) of the stored arrays."""
        n_pad, k_pad = self.qweight.shape
        return k_pad, n_pad

    @property
    def num_groups(self) -> int:
        return self.scales.shape[-2]

    @property
    def two_level(self) -> bool:
        """Whether the group rows are uint8 codes under float16 super-group rows."""
        return self.super_scales is not None

    @property
    def super_group(self) -> int:
        """K elements per super-group row (two-level only)."""
        return self.group_size * (self.num_groups // self.super_scales.shape[-2])


def is_per_channel(qw: QuantizedWeight) -> bool:
    """One scale per output channel over all of K (int8 / fp8 quantized at load), no offsets."""
    return qw.format in ("int8", "fp8") and qw.num_groups == 1 and qw.zeros is None


QWEIGHT_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4}


def layout_problem(qw: QuantizedWeight) -> str | None:
    """What makes `qw` inconsistent with the layout above (for weights read from a file), or None."""
    if qw.format not in QWEIGHT_DTYPES:
        return f"unknown format {qw.format!r}"
    if qw.qweight.ndim != 2 or jnp.dtype(qw.qweight.dtype) != jnp.dtype(QWEIGHT_DTYPES[qw.format]):
        return f"qweight is {qw.qweight.dtype}{list(qw.qweight.shape)}, expected a 2-D {qw.format} array"
    (k, n), (k_pad, n_pad), g = qw.shape, qw.padded_shape, qw.group_size
    if not (0 < k <= k_pad and 0 < n <= n_pad) or g <= 0 or k_pad % g:
        return f"stored [{n_pad}, {k_pad}] does not hold logical {(k, n)} in groups of {g}"
    rows = (k_pad // g, n_pad)
    if tuple(qw.scales.shape) != rows or (qw.zeros is not None and tuple(qw.zeros.shape) != rows):
        zeros = None if qw.zeros is None else list(qw.zeros.shape)
        return f"group rows {list(qw.scales.shape)} (zeros {zeros}), expected {list(rows)}"
    if qw.zero_point and (qw.format != "int4" or qw.zeros is None or qw.two_level):
        return "integer zero points need int4 with a zeros array and one level of rows"
    supers = [r for r in (qw.super_scales, qw.super_zeros) if r is not None]
    if qw.super_zeros is not None and (qw.super_scales is None or qw.zeros is None):
        return "super_zeros without super_scales and zeros"
    for r in supers:
        if r.ndim != 2 or r.shape[1] != n_pad or not r.shape[0] or rows[0] % r.shape[0]:
            return f"super-group rows {list(r.shape)} do not divide the group rows {list(rows)}"
    return None


# The [rows, N_pad] arrays of group rows, in the order the kernels take them; each row covers
# `row_span` K elements.
GROUP_ROWS = ("scales", "zeros", "super_scales", "super_zeros")
ARRAY_FIELDS = ("qweight",) + GROUP_ROWS


def n_axis(name: str) -> int:
    """The output-channel (N) axis of a stored array: qweight is [N_pad, K_pad], group rows [rows, N_pad]."""
    return -2 if name == "qweight" else -1


def k_axis(name: str) -> int:
    """The K axis of a stored array (group rows: one row per `row_span` K elements)."""
    return -1 if name == "qweight" else -2


def row_span(qw: QuantizedWeight, name: str) -> int:
    """K elements covered by one row of the group-row array `name`."""
    return qw.super_group if name.startswith("super_") else qw.group_size


def group_scales(qw: QuantizedWeight) -> jax.Array:
    """[G, N_pad] float32: each group's scale (two-level rows multiplied out)."""
    return _two_level(qw.scales, qw.super_scales)


def group_zeros(qw: QuantizedWeight) -> jax.Array | None:
    """[G, N_pad] float32 zero points or float offsets (two-level rows multiplied out), or None."""
    return None if qw.zeros is None else _two_level(qw.zeros, qw.super_zeros)


def _two_level(rows, super_rows):
    rows = rows.astype(jnp.float32)
    if super_rows is None:
        return rows
    r = rows.shape[-2] // super_rows.shape[-2]
    return rows * jnp.repeat(super_rows.astype(jnp.float32), r, axis=-2)


def one_level(qw: QuantizedWeight) -> QuantizedWeight:
    """The weight with two-level group rows multiplied out into float32 ones (the same values)."""
    if not qw.two_level:
        return qw
    return dataclasses.replace(qw, scales=group_scales(qw), zeros=group_zeros(qw), super_scales=None,
                               super_zeros=None)


# "mma order": each block of 32 K positions of a qweight row is stored in the order the kernel's
# matrix instruction consumes it. Thread t of a row's quad holds, in wgmma's A-fragment layout, the
# column pairs 8q + 2t + {0, 1} of each 8-column slice q of the block (q, b: slice, pair element):
# in mma order those eight columns are stored positions 8t .. 8t + 7, which the kernels load as one
# 32-bit (int4) or 64-bit (int8) word per thread, converted without moving data between threads.
# - int4 (pallas_kernels/int4_mma_order.py): stored 8t + 4b + q holds column 8q + 2t + b, so the
#   pair of slice q sits at nibbles q and q + 4 of the thread's word;
# - int8 (pallas_kernels/int8_mma_order.py): stored 8t + 4h + 2b + l holds column 16h + 8l + 2t + b
#   (slice q = 2h + l), so the pair of slice q sits at bytes l and l + 2 of the thread's word h.
MMA_BLOCK = 32
# per format: the natural block's factors (sizes, outermost first) and their stored order
_MMA_ORDERS = {
    "int4": ((4, 4, 2), (1, 2, 0)),         # natural [q, t, b] -> stored [t, b, q]
    "int8": ((2, 2, 4, 2), (2, 0, 3, 1)),   # natural [h, l, t, b] -> stored [t, h, b, l]
}


def _permute_blocks(q, sizes, perm):
    *lead, k = q.shape
    blocks = q.reshape(*lead, k // MMA_BLOCK, *sizes)
    n = len(lead) + 1
    return blocks.transpose(*range(n), *(n + p for p in perm)).reshape(q.shape)


def to_mma_order(q, fmt: str = "int4"):
    """[..., K] (K a multiple of 32) natural order -> `fmt`'s mma order. numpy or jax arrays."""
    sizes, perm = _MMA_ORDERS[fmt]
    return _permute_blocks(q, sizes, perm)


def from_mma_order(q, fmt: str = "int4"):
    """Inverse of `to_mma_order`."""
    sizes, perm = _MMA_ORDERS[fmt]
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return _permute_blocks(q, tuple(sizes[p] for p in perm), tuple(inverse))


def takes_mma_order(qw: QuantizedWeight) -> bool:
    """Whether `qw` can be stored in mma order: int4 (any groups), and per-channel int8, whose K_pad
    is a multiple of 32."""
    per_channel_int8 = qw.format == "int8" and qw.num_groups == 1 and qw.zeros is None
    return (qw.format == "int4" or per_channel_int8) and qw.qweight.shape[-1] % MMA_BLOCK == 0


def with_mma_order(qw: QuantizedWeight, mma_order: bool = True) -> QuantizedWeight:
    """The same weight with its qweight stored in (or out of) mma order; a weight that cannot take
    it (`takes_mma_order`) is returned as it is."""
    if qw.mma_order == mma_order or not takes_mma_order(qw):
        return qw
    convert = to_mma_order if mma_order else from_mma_order
    return dataclasses.replace(qw, qweight=convert(qw.qweight, qw.format), mma_order=mma_order)


def permuted_like_mma_order(x, qw: QuantizedWeight):
    """(x', w') with x' @ w' = x @ qw, w' the stored codes read in natural order: int8 mma order
    permutes K within blocks of 32, so x's K is permuted alike. x: [..., K_pad] (padded with zeros);
    w' has logical shape (K_pad, N). Other weights are returned as they are."""
    if not (qw.mma_order and qw.format == "int8"):
        return x, qw
    k_pad, _ = qw.padded_shape
    return to_mma_order(x, "int8"), dataclasses.replace(qw, mma_order=False, shape=(k_pad, qw.shape[1]))


def with_float_offsets(qw: QuantizedWeight) -> QuantizedWeight:
    """The weight with its integer zero points rewritten as float offsets, stored like the scales
    (GGUF Q4_1's form): (q + 8) s + zeros' = (q - z) s for zeros' = -(z + 8) s, up to the rounding
    of zeros' to the scales' dtype."""
    if not qw.zero_point:
        return qw
    s, z = group_scales(qw), group_zeros(qw)
    return dataclasses.replace(qw, zeros=(-(z + 8.0) * s).astype(qw.scales.dtype), zero_point=False)


def group_offsets(qw: QuantizedWeight) -> jax.Array:
    """[G, N_pad] float32 b such that w = q * s + b for an asymmetric weight (either kind of zeros)."""
    s, z = group_scales(qw), group_zeros(qw)
    return -z * s if qw.zero_point else 8.0 * s + z


def codes_as_bf16(q):
    """int8 / int4 / e4m3 codes as bf16, exactly (all are bf16 values), in jnp or inside a Mosaic GPU
    kernel: sm_90 has no e4m3 -> bf16 conversion, e4m3 -> f16 is exact."""
    if q.dtype == jnp.float8_e4m3fn:
        q = q.astype(jnp.float16)
    return q.astype(jnp.bfloat16)


def natural_codes(qw: QuantizedWeight) -> jax.Array:
    """qweight [N_pad, K_pad] with any mma order undone."""
    return from_mma_order(qw.qweight, qw.format) if qw.mma_order else qw.qweight


def dequantize_nk(qw: QuantizedWeight, dtype=jnp.bfloat16) -> jax.Array:
    """The padded weight as stored, W.T [N_pad, K_pad] (K minor), in `dtype` (computed in float32):
    what a GEMM contracting both operands' minor dims reads without a transpose.

    A bf16 result is computed two values per 32-bit word (`_bf16_pairs`): XLA's elementwise kernels
    run one output element per thread, and 2-byte elements write at ~3.3 TB/s on an H200 against
    ~4.2 for 4-byte ones (docs/performance.md, sessions 84-85). The values are the same."""
    k_pad, n_pad = qw.padded_shape
    g = qw.group_size
    pairs = jnp.dtype(dtype) == jnp.bfloat16 and g % 2 == 0
    q = natural_codes(qw).astype(jnp.float32)
    q = q.reshape(n_pad, k_pad // g, g // 2, 2) if pairs else q.reshape(n_pad, k_pad // g, 1, g)
    s = group_scales(qw).T[:, :, None, None]   # [N_pad, G, 1, 1]
    z = None if qw.zeros is None else group_zeros(qw).T[:, :, None, None]
    if z is not None and qw.zero_point:
        w = (q - z) * s
    elif z is not None:
        w = (q + 8.0) * s + z
    else:
        w = q * s
    w = w.astype(dtype)
    return (_bf16_pairs(w) if pairs else w).reshape(n_pad, k_pad)


def _bf16_pairs(w: jax.Array) -> jax.Array:
    """[..., 2] bf16 -> [..., 2] through one uint32 word per pair (the first value in the low half, as
    `from_words` reads it back): the same values, computed by a kernel writing words."""
    halves = lax.bitcast_convert_type(w, jnp.uint16).astype(jnp.uint32)
    return from_words(halves[..., 0] | (halves[..., 1] << 16), jnp.bfloat16)


def dequantize(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The logical weight W[K, N] in `dtype` (computed in float32)."""
    k, n = qw.shape
    return dequantize_nk(qw, jnp.float32).T[:k, :n].astype(dtype)

"""GGUF weight blocks (llama.cpp's quantized tensors) as the engine's `QuantizedWeight`s.

How a linear projection stored in a GGML block type loads when it is kept quantized (`gguf_weight`):
- Q8_0, Q5_0, Q4_0, Q4_1 (blocks of 32): as stored, exact in float32: int8 (Q8_0, and Q5_0's
  symmetric 5-bit values q - 16) or int4 with groups of 32, the block's fp16 scale, and Q4_1's min
  as the group's float offset.
- Q4_K (super-blocks of 256: eight sub-blocks of 32, each with a 6-bit scale sc and min m under
  the super-block's fp16 d and dmin, w = d*sc*q - dmin*m): as stored, exact in float32: int4 with
  groups of 32 and float offsets in two levels (`QuantizedWeight.super_scales`): sc and m as uint8
  rows, d and -dmin as float16 rows per 256. That is 4.625 bits per weight on the device, the
  file's 4.5 plus a byte instead of 6 bits for each sc and m.
- every other block type (Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, the IQ types): dequantized by the
  `gguf` package and re-quantized to symmetric int8 with groups of 32. None has more than 64 levels
  in a group of 32, so int8's 255 (a step of 1/127 of the group's largest magnitude) adds an
  error well under the source format's own.
Float tensors (F32, F16, BF16) are not block types; the loader reads them as floats.

Q4_K's layout (ggml's `block_q4_K`, 144 bytes): d and dmin (fp16), 12 bytes packing the eight 6-bit
scales and mins, then 128 bytes of nibbles. Bytes 0-3 hold the low 6 bits of scales 0-3 and bytes
4-7 those of mins 0-3; their top 2 bits are the high bits of scales / mins 4-7, whose low 4 bits sit
in bytes 8-11 (scale in the low nibble, min in the high). Nibble bytes 32c .. 32c + 31 hold
sub-block 2c in their low nibbles and sub-block 2c + 1 in their high ones.
"""
from __future__ import annotations

from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.quantization import QuantizedWeight, from_codes, quantize

BLOCK = 32   # the group size of every kept GGUF weight
# bytes per block of the types read as stored: 32 values, or Q4_K's super-block of 256
_TYPE_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
_BLOCK_VALUES = {"Q8_0": 32, "Q5_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256}
AS_STORED = tuple(_TYPE_BYTES)
_ELEMENT_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


def type_name(qtype: Any) -> str:
    """The GGML type's name from a `gguf.GGMLQuantizationType`, its int id or its name."""
    try:
        if isinstance(qtype, str):
            return gguf.GGMLQuantizationType[qtype.upper()].name
        return gguf.GGMLQuantizationType(int(qtype)).name
    except (KeyError, ValueError):
        raise ValueError(f"unknown GGML type {qtype!r}") from None


def is_block_type(qtype: Any) -> bool:
    """Whether the type is a quantized block format (not a plain float or integer element type)."""
    return type_name(qtype) not in _ELEMENT_TYPES


def kept_format(qtype: Any) -> str:
    """The engine format ("int4" or "int8", groups of 32) a block type is kept in."""
    return "int4" if type_name(qtype) in ("Q4_0", "Q4_1", "Q4_K") else "int8"


def like_gguf(w: Any, qtype: Any) -> QuantizedWeight:
    """A float weight W[K, N] quantized into the layout a GGUF tensor of `qtype` loads into: the
    same format, group size and kind of zeros as `gguf_weight` gives (int4 with float offsets for
    Q4_K / Q4_1, two-level for Q4_K, symmetric int4 for Q4_0, int8 for the rest), so the kernels
    run what they would for such a file. The values are this quantizer's, not llama.cpp's (for benchmarks and tests)."""
    from pallas_kernels.quant_format import with_float_offsets  # noqa: PLC0415
    name = type_name(qtype)
    if kept_format(name) == "int8":
        return quantize(w, "int8", group_size=BLOCK)
    if name == "Q4_0":
        return quantize(w, "int4", group_size=BLOCK, symmetric=True)
    if name == "Q4_K" and w.shape[0] % _BLOCK_VALUES["Q4_K"] == 0:
        return _like_q4_k(w)
    return with_float_offsets(quantize(w, "int4", group_size=BLOCK, symmetric=False))


def _like_q4_k(w) -> QuantizedWeight:
    """W[K, N] (K a multiple of 256) quantized the Q4_K way, in the layout a Q4_K tensor loads into."""
    from atlasjax.quantization import padded_sizes  # noqa: PLC0415
    from pallas_kernels.quant_format import with_mma_order  # noqa: PLC0415
    k, n = w.shape
    q, sc, m, d, neg_dmin = _q4_k_codes(jnp.asarray(w, jnp.float32))
    k_pad, n_pad, _ = padded_sizes(k, n, BLOCK)

    def pad(x, axis):
        return jnp.pad(x, [(0, n_pad - n) if i == axis else (0, 0) for i in range(x.ndim)])
    qw = QuantizedWeight(pad(q, 0).astype(jnp.int4), pad(sc, 1), pad(m, 1), "int4", BLOCK, (k, n),
                         super_scales=pad(d, 1), super_zeros=pad(neg_dmin, 1))
    return with_mma_order(qw)


@jax.jit
def _q4_k_codes(w):
    """`_like_q4_k`'s codes: per group of 32 the range [min(w, 0), max(w, 0)] in 15 steps; per 256
    the groups' scales and mins as 6-bit multiples of d and dmin (float16); codes against those."""
    k, n = w.shape
    groups = w.reshape(k // BLOCK, BLOCK, n)
    lo, hi = jnp.minimum(groups.min(1), 0.0), jnp.maximum(groups.max(1), 0.0)   # [G, N]
    per = _BLOCK_VALUES["Q4_K"] // BLOCK   # groups per super-block

    def six_bit(x):   # [G, N] >= 0 -> codes in 0..63, their float16 unit per 256 [S, N], that unit per group
        unit = (x.reshape(-1, per, n).max(1) / 63).astype(jnp.float16)
        u = jnp.repeat(unit.astype(jnp.float32), per, axis=0)
        return jnp.where(u > 0, jnp.round(x / jnp.where(u > 0, u, 1.0)), 0).clip(0, 63), unit, u
    sc, d, d_rows = six_bit((hi - lo) / 15)
    m, dmin, dmin_rows = six_bit(-lo)
    s, offset = sc * d_rows, -m * dmin_rows
    q = jnp.where(s[:, None] > 0, jnp.round((groups - offset[:, None]) / jnp.where(s > 0, s, 1.0)[:, None]), 0)
    q = q.clip(0, 15).reshape(k, n).T.astype(jnp.int8) - 8
    return q, sc.astype(jnp.uint8), m.astype(jnp.uint8), d, -dmin


def gguf_weight(raw: np.ndarray, qtype: Any, shape_hf: tuple[int, int]) -> QuantizedWeight:
    """A GGUF linear weight in any block type, kept quantized (the module docstring says how).

    Args:
      raw: the tensor's block bytes in row order (GGUFReader gives [N, bytes_per_row] uint8).
      qtype: its GGML type (`gguf.GGMLQuantizationType`, int id or name): a block type.
      shape_hf: (out_features N, in_features K), the Hugging Face [N, K] shape.
    Returns: a QuantizedWeight of logical shape (K, N) with groups of 32.
    """
    name = type_name(qtype)
    if name in AS_STORED:
        return from_gguf_blocks(raw, name, shape_hf)
    if not is_block_type(name):
        raise ValueError(f"GGUF type {name} is not a quantized block type")
    w = gguf.quants.dequantize(np.ascontiguousarray(raw).view(np.uint8), gguf.GGMLQuantizationType[name])
    return quantize(np.asarray(w, np.float32).reshape(shape_hf).T, "int8", group_size=BLOCK)


def from_gguf_blocks(raw: np.ndarray, qtype: Any, shape_hf: tuple[int, int]) -> QuantizedWeight:
    """Reads a Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K linear weight as it is stored, without re-quantizing.

    Args: as `gguf_weight`.
    Returns:
      QuantizedWeight of logical shape (K, N) with groups of 32. Its `dequantize` equals
      `gguf.quants.dequantize(raw, qtype).T` exactly in float32 (Q4_K: up to the order of the
      float32 products d * sc * q).
    """
    name = type_name(qtype)
    if name not in AS_STORED:
        raise ValueError(f"GGUF type {name} is not supported here; supported: {list(AS_STORED)}")
    n, k = shape_hf
    values = _BLOCK_VALUES[name]
    if k % values:
        raise ValueError(f"in_features {k} is not a multiple of the {name} block size {values}")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // values, _TYPE_BYTES[name])
    if name == "Q4_K":
        q, sc, mins, d, dmin = _q4_k(blocks)
        return from_codes(q.reshape(n, k), sc.reshape(n, -1).T, mins.reshape(n, -1).T, format="int4",
                          group_size=BLOCK, super_scales=d.T, super_zeros=-dmin.T)
    else:
        scales = _f16(blocks[..., 0:2])          # [N, K/32], as stored
        zeros = _f16(blocks[..., 2:4]) if name == "Q4_1" else None
        if name == "Q8_0":
            q = blocks[..., 2:].copy().view(np.int8)   # [N, K/32, 32]
        elif name == "Q5_0":   # d, 32 fifth bits (little-endian), then the low nibbles
            fifth = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")
            q = (_split_nibbles(blocks[..., 6:]) | (fifth << 4)).astype(np.int8) - 16
        else:
            q = _split_nibbles(blocks[..., 4 if name == "Q4_1" else 2:]).astype(np.int8) - 8
    return from_codes(q.reshape(n, k), scales.reshape(n, -1).T, None if zeros is None else zeros.reshape(n, -1).T,
                      format=kept_format(name), group_size=BLOCK)


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian fp16 bytes -> [...] float16."""
    return two_bytes.copy().view(np.float16)[..., 0]


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] packed bytes -> [..., 32] values 0..15: element j is byte j's low nibble, j+16 its high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_k(blocks: np.ndarray):
    """[N, S, 144] Q4_K super-blocks -> (q [N, S, 256] int8 nibble - 8, sc and m [N, S, 8] uint8
    per sub-block of 32, d and dmin [N, S] float16), so that w = (q + 8) * d * sc - dmin * m."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    low_sc, low_m, high = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([low_sc & 63, (high & 15) | ((low_sc >> 6) << 4)], axis=-1)
    mins = np.concatenate([low_m & 63, (high >> 4) | ((low_m >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 1, 32)
    q = (np.concatenate([qs & 15, qs >> 4], axis=-2).astype(np.int8) - 8).reshape(*blocks.shape[:2], 256)
    return q, sc, mins, d, dmin

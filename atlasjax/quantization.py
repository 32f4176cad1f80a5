"""Weight-only quantization formats: the `QuantizedWeight` pytree, quantize / dequantize, GGUF blocks.

One `QuantizedWeight` holds one linear layer's weight, logically `W[K, N]` with `y = x @ W`
(K = in_features, N = out_features). The fused kernels in `pallas_kernels/quantized_matmul.py`
consume it; `dequantize` is the exact meaning of every format.

Storage layout (the same for every format, chosen for the kernels):
- `qweight`: `[N_pad, K_pad]`, output-channel major with K contiguous (the Hugging Face / GGUF
  layout, i.e. W transposed). The kernels compute `y.T = W.T @ x.T` with the weight tile as the
  register operand of the matrix instruction, so this is the layout they stream.
  dtype: `int8` ("int8"), `float8_e4m3fn` ("fp8"), `int4` ("int4": signed nibbles q in [-8, 7],
  packed two per byte in device memory by XLA, each 32-element K block in "mma order", the order
  the kernel's matrix instruction reads it: `QuantizedWeight.mma_order`, `to_mma_order`).
- `scales`: `[K_pad // group_size, N_pad]`, one row per K-group: float32 per output channel,
  float16 for groups (quantized at load, the codes computed with the rounded scale; or GGUF's
  own). The kernels multiply in float32 whatever the storage.
- `zeros`: `[K_pad // group_size, N_pad]` float16 or None. Only asymmetric "int4" uses it, in one
  of two ways (`zero_point`, static): the integer zero point z of the group, a whole number in
  [-8, 7] (quantize at load), or the group's additive float offset (GGUF Q4_1's min).
- `super_scales`, `super_zeros`: None, or two-level group rows, as GGUF K-quants store them (Q4_K:
  a 6-bit scale and min per group of 32 under a float16 d and dmin per super-group of 256).
  `scales` and `zeros` then hold uint8 codes, and these `[K_pad // 256, N_pad]` float16 rows
  multiply them: scale = scales[g, n] * super_scales[g // 8, n], offset likewise (4.625 bits per
  weight for Q4_K instead of 5 with float16 rows).
- Padding: `N_pad` is `N` rounded up to `N_ALIGN`, `K_pad` is `K` rounded up to `K_ALIGN` (and to a
  multiple of `group_size`). Padded entries dequantize to 0. The Llama/Qwen shapes need none.

Dequantization, per element (k, n) with g = k // group_size:
- "int8", "fp8":           w = float(q) * scales[g, n]
- "int4", zeros is None:   w = float(q) * scales[g, n]                (symmetric, GGUF Q4_0)
- "int4", zero points:     w = float(q - zeros[g, n]) * scales[g, n]  (asymmetric, quantized at load)
- "int4", float offsets:   w = float(q + 8) * scales[g, n] + zeros[g, n]   (asymmetric, GGUF Q4_1 / Q4_K)
  (with two-level rows, scales and zeros here are the products above)
These are exact in float32 for GGUF Q8_0 / Q4_0 / Q4_1 blocks (atlasjax/gguf_blocks.py). With integer
zero points, q - z is a whole number in [-15, 15], exact in bf16, so the kernel subtracts it from
the dequantized tile and needs no offset term (docs/perf_quant.md, session 11).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "fp8", "int4")
N_ALIGN = 128  # output-channel padding: the kernels' widest N tile
K_ALIGN = 256  # input-channel padding: the kernels' widest K step
DEFAULT_GROUP_SIZE = {"int8": None, "fp8": None, "int4": 128}  # None: per output channel
FP8_MAX = 448.0  # largest finite float8_e4m3fn
from pallas_kernels.quant_format import (  # noqa: E402,F401 (QuantizedWeight, dequantize re-exported)
    ARRAY_FIELDS, GROUP_ROWS, MMA_BLOCK, QuantizedWeight, dequantize, is_per_channel, k_axis, n_axis, one_level,
    row_span, to_mma_order, with_mma_order)

DEFAULT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_sizes(k: int, n: int, group_size: int | None) -> tuple[int, int, int]:
    """(K_pad, N_pad, group_size) for a logical K x N weight; group_size None means per channel."""
    k_pad = _round_up(k, K_ALIGN)
    if group_size is None:
        return k_pad, _round_up(n, N_ALIGN), k_pad
    k_pad = _round_up(k, math.lcm(K_ALIGN, group_size))
    return k_pad, _round_up(n, N_ALIGN), group_size


def _validate_group(fmt: str, group_size: int | None) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    if group_size is not None and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")


# ---------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("fmt", "group_size", "symmetric", "k_pad", "n_pad"))
def _quantize_padded(w, *, fmt, group_size, symmetric, k_pad, n_pad):
    # w: [K, N] float -> groups along K: [G, group_size, N_pad]
    k, n = w.shape
    w = jnp.pad(w.astype(jnp.float32), ((0, k_pad - k), (0, n_pad - n)))
    wg = w.reshape(k_pad // group_size, group_size, n_pad)
    # Group scales (int4, or any grouping along K) are stored in float16, as GGUF and GPTQ store
    # them, and the codes computed with the rounded scale (a group's extremes may then clip by at
    # most 15 * 2^-11 of a step); per-channel scales stay f32 (their bytes do not matter).
    compact = fmt == "int4" or group_size < k_pad
    zeros = None
    if fmt == "int4" and not symmetric:
        # The group's range, widened to hold 0 (so 0 is exact), on a grid of 16 steps whose zero
        # point u0 is a whole number: w = (u - u0) s, stored as q = u - 8 and z = u0 - 8.
        lo, hi = jnp.minimum(wg.min(axis=1), 0.0), jnp.maximum(wg.max(axis=1), 0.0)  # [G, N_pad]
        scales = (hi - lo) / 15.0
        scales = _f16_values(scales) if compact else scales
        inv = jnp.where(scales > 0, 1.0 / jnp.where(scales > 0, scales, 1.0), 0.0)
        u0 = jnp.clip(jnp.round(-lo * inv), 0, 15)
        u = jnp.clip(jnp.round(wg * inv[:, None]) + u0[:, None], 0, 15)
        q = (u - 8).astype(jnp.int4)
        zeros = u0 - 8.0
    else:
        qmax = {"int8": 127.0, "fp8": FP8_MAX, "int4": 7.0}[fmt]
        scales = jnp.abs(wg).max(axis=1) / qmax  # [G, N_pad]
        scales = _f16_values(scales) if compact else scales
        inv = jnp.where(scales > 0, 1.0 / jnp.where(scales > 0, scales, 1.0), 0.0)
        scaled = wg * inv[:, None]
        if fmt == "fp8":
            q = jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
        else:
            q = jnp.clip(jnp.round(scaled), -qmax - (fmt == "int4"), qmax)
            q = q.astype(jnp.int8 if fmt == "int8" else jnp.int4)
    qweight = q.reshape(k_pad, n_pad).T  # [N_pad, K_pad]
    if fmt == "int4":   # stored in mma order (pallas_kernels/int4_mma_order.py), inside this jit
        qweight = to_mma_order(qweight)
    if compact:
        scales = scales.astype(jnp.float16)
        zeros = None if zeros is None else zeros.astype(jnp.float16)
    return qweight, scales, zeros


def _f16_values(x):
    """x (>= 0) rounded to the nearest float16 values (subnormals included, capped at the largest
    finite one), kept in float32. The barrier keeps the rounding: inside a fusion XLA may otherwise
    skip a round trip through a narrower float (`xla_allow_excess_precision`, on by default), which
    on a GPU computed the codes with the unrounded scale while the rounded one was stored, up to
    127 * 2^-11 of a step off for int8 groups (session 34)."""
    f16 = jnp.minimum(x, float(jnp.finfo(jnp.float16).max)).astype(jnp.float16)
    return jax.lax.optimization_barrier(f16).astype(jnp.float32)


def quantize(
    w: jax.Array | np.ndarray,
    format: str,
    *,
    group_size: int | None = None,
    symmetric: bool | None = None,
) -> QuantizedWeight:
    """Quantizes a float weight W[K, N] (y = x @ W).

    Args:
      w: [K, N] float (any float dtype).
      format: "int8" (symmetric), "fp8" (e4m3, symmetric) or "int4" (symmetric or asymmetric).
      group_size: K-group size (power of two >= 16); default per output channel for int8/fp8 and
        128 for int4.
      symmetric: int4 only: False stores a per-group integer zero point in `zeros`. None: the
        format's default, which is what the engine quantizes at load: asymmetric for int4 (more
        accurate, and as fast with zero points: docs/quantization.md), symmetric otherwise.
    Returns:
      The QuantizedWeight; `dequantize` of it approximates w.
    """
    group_size = DEFAULT_GROUP_SIZE.get(format) if group_size is None else group_size
    _validate_group(format, group_size)
    if symmetric is None:
        symmetric = format != "int4"
    if not symmetric and format != "int4":
        raise ValueError(f"format {format!r} is symmetric only; asymmetric is int4")
    if w.ndim != 2:
        raise ValueError(f"expected a [K, N] matrix, got shape {w.shape}")
    k, n = w.shape
    k_pad, n_pad, group_size = padded_sizes(k, n, group_size)
    qweight, scales, zeros = _quantize_padded(
        jnp.asarray(w), fmt=format, group_size=group_size, symmetric=symmetric,
        k_pad=k_pad, n_pad=n_pad)
    # int4 is stored in mma order: the kernel then converts a 32-bit word per eight weights
    # (docs/perf_quant.md, session 14)
    return QuantizedWeight(qweight, scales, zeros, format, group_size, (k, n), zero_point=zeros is not None,
                           mma_order=format == "int4")


def from_codes(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None = None, *, format: str,
               group_size: int | None, zero_point: bool = False, super_scales: np.ndarray | None = None,
               super_zeros: np.ndarray | None = None) -> QuantizedWeight:
    """A weight already quantized elsewhere (GGUF blocks, checkpoints saved quantized), padded and
    laid out as `quantize` lays it out; no value changes.

    Args:
      codes: [N, K] stored values: int8 (int4 codes in [-8, 7] for "int4") or float8_e4m3fn.
      scales: [G, N], G = K / group_size (1 per channel); float16 / float32 kept, others -> float32;
        uint8 codes with `super_scales`.
      zeros: [G, N] or None: integer zero points (`zero_point`) or float offsets, stored as float16;
        uint8 codes with `super_zeros`.
      group_size: along K; None per channel.
      super_scales, super_zeros: [S, N] float16 rows of two-level groups (`QuantizedWeight`), each
        over G / S groups; K a multiple of their span.
    """
    n, k = codes.shape
    k_pad, n_pad, group = padded_sizes(k, n, group_size)
    q = np.zeros((n_pad, k_pad), codes.dtype)
    q[:n, :k] = codes

    def rows(x, dtype, span=group):   # [k / span, N] -> [K_pad / span, N_pad]
        out = np.zeros((k_pad // span, n_pad), dtype)
        out[: x.shape[0], :n] = x[:, :n]
        return jnp.asarray(out)
    two_level = super_scales is not None
    if two_level and (k % (k // super_scales.shape[0]) or (zeros is None) != (super_zeros is None)):
        raise ValueError("two-level group rows need K a multiple of their super-group and zeros matching")
    if two_level:
        span = k // super_scales.shape[0]
        s, z = rows(scales, np.uint8), None if zeros is None else rows(zeros, np.uint8)
        ss, sz = rows(super_scales, np.float16, span), None if zeros is None else rows(super_zeros, np.float16, span)
    else:
        s = rows(scales, scales.dtype if scales.dtype in (np.float16, np.float32) else np.float32)
        z = None if zeros is None else rows(zeros, np.float16)
        ss = sz = None
    qw = QuantizedWeight(jnp.asarray(q.astype(jnp.int4) if format == "int4" else q), s, z, format, group, (k, n),
                         zero_point=zero_point, super_scales=ss, super_zeros=sz)
    return with_mma_order(qw) if format == "int4" else qw   # int4 in mma order, as `quantize` stores it


def slice_quantized(qw: QuantizedWeight, dim: int, start: int, size: int) -> QuantizedWeight:
    """The block W[start:start+size, :] (dim 0, along K) or W[:, start:start+size] (dim 1, along N)
    of a quantized weight, as its own QuantizedWeight (padded as `quantize` pads; host arrays, or
    arrays on the device that holds qw's).

    The quantized values and scales are the original ones, so a split weight computes exactly what
    the whole one does (tensor parallelism). Splitting K needs whole groups unless scales are per
    channel (then every block keeps the channel scales); a cut inside a two-level super-group
    multiplies its rows out first (`one_level`: float32 rows, the same values).
    A block reaching past the end of the weight gets zero columns (rows) there, which dequantize to
    0: the padded end of a vocab-parallel LM head whose vocab does not split evenly.
    """
    from atlasjax.errors import EngineConfigError  # noqa: PLC0415
    if qw.mma_order and dim == 0 and (start % MMA_BLOCK or size % MMA_BLOCK):
        # a cut inside a permuted block of 32 (groups of 16): slice the natural order
        return with_mma_order(slice_quantized(with_mma_order(qw, False), dim, start, size))
    if qw.two_level and dim == 0 and (start % qw.super_group or size % qw.super_group):
        return slice_quantized(one_level(qw), dim, start, size)
    k, n = qw.shape
    per_channel = qw.num_groups == 1
    on_device = isinstance(qw.qweight, jax.Array)   # then it is cut there
    arrays = {f: getattr(qw, f) if on_device else np.asarray(getattr(qw, f))
              for f in ARRAY_FIELDS if getattr(qw, f) is not None}   # absent: None
    if dim == 1:
        new_k, new_n = k, size
        arrays = {f: cut(a, n_axis(f), start, start + size) for f, a in arrays.items()}
    else:
        g = qw.group_size
        if not per_channel and (start % g or size % g):
            raise EngineConfigError(f"cannot split a {qw.format} weight with {g}-wide groups at rows "
                                    f"[{start}, {start + size}) for tensor parallelism")
        new_k, new_n = size, n
        for f, a in arrays.items():
            if f == "qweight" or not per_channel:   # per-channel rows stay whole
                r = 1 if f == "qweight" else row_span(qw, f)
                arrays[f] = cut(a, k_axis(f), start // r, (start + size) // r)
    k_pad, n_pad, group_size = padded_sizes(new_k, new_n, None if per_channel else qw.group_size)
    qweight = arrays.pop("qweight")
    qweight = pad(qweight, ((0, n_pad - qweight.shape[0]), (0, k_pad - qweight.shape[1])))

    def padded(f, a):
        r = k_pad if per_channel else row_span(qw, f)
        return pad(a, ((0, k_pad // r - a.shape[0]), (0, n_pad - a.shape[1])))
    return QuantizedWeight(qweight, format=qw.format, group_size=group_size, shape=(new_k, new_n),
                           zero_point=qw.zero_point, mma_order=qw.mma_order, activations=qw.activations,
                           **{f: padded(f, arrays[f]) if f in arrays else None for f in GROUP_ROWS})


def pad(a, widths: tuple[tuple[int, int], ...]):
    """a zero-padded by `widths` ((before, after) per axis), on the host or on a's device (compiled
    there: no fill value crosses from the host)."""
    return _pad_on_device(a, widths) if isinstance(a, jax.Array) else np.pad(a, widths)


_pad_on_device = jax.jit(jnp.pad, static_argnums=1)


def cut(a, axis: int, start: int, stop: int):
    """a[start:stop] along `axis`: a numpy view, or a static slice of an array on a device (no index
    crosses from the host)."""
    if isinstance(a, jax.Array):
        return jax.lax.slice_in_dim(a, start, stop, axis=axis)
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return a[tuple(index)]


def concat_quantized(parts: list[QuantizedWeight], dim: int) -> QuantizedWeight:
    """Join weights along K (dim 0) or N (dim 1): the inverse of `slice_quantized` (and how fused
    projections are built). Each part's padding is dropped and the result padded as `quantize` pads;
    arrays may carry leading (device) axes, kept as they are. Along K, per-channel scales are the
    parts' shared channel scales (slice_quantized keeps them whole). Parts with two-level group rows
    among one-level ones are multiplied out first (`one_level`)."""
    if len({p.two_level for p in parts}) > 1:
        parts = [one_level(p) for p in parts]
    first = parts[0]
    if first.mma_order and dim == 0 and any(p.shape[0] % MMA_BLOCK for p in parts):
        # a join inside a permuted block of 32: join the natural order
        return with_mma_order(concat_quantized([with_mma_order(p, False) for p in parts], dim))
    k, n = first.shape
    per_channel = first.scales.shape[-2] == 1
    ks, ns = tuple(p.shape[0] for p in parts), tuple(p.shape[1] for p in parts)
    new_k, new_n = (k, sum(ns)) if dim == 1 else (sum(ks), n)
    k_pad, n_pad, group = padded_sizes(new_k, new_n, None if per_channel else first.group_size)

    def join(name, axis, sizes, size):
        leaves = [getattr(p, name) for p in parts]
        return None if leaves[0] is None else _join_padded(leaves, sizes=sizes, axis=axis, size=size)
    if dim == 1:
        arrays = {f: join(f, n_axis(f), ns, n_pad) for f in ARRAY_FIELDS}
    elif per_channel:
        arrays = {"qweight": join("qweight", -1, ks, k_pad), **{f: getattr(first, f) for f in GROUP_ROWS}}
    else:
        arrays = {}
        for f in ARRAY_FIELDS:
            r = 1 if f == "qweight" or getattr(first, f) is None else row_span(first, f)
            arrays[f] = join(f, k_axis(f), tuple(x // r for x in ks), k_pad // r)
    return QuantizedWeight(format=first.format, group_size=group, shape=(new_k, new_n),
                           zero_point=first.zero_point, mma_order=first.mma_order,
                           activations=first.activations, **arrays)


@functools.partial(jax.jit, static_argnames=("sizes", "axis", "size"))
def _join_padded(xs, sizes, axis, size):
    """The first sizes[i] entries of each x along `axis`, concatenated, zero-padded to `size`."""
    ax = xs[0].ndim + axis
    x = jnp.concatenate([jax.lax.slice_in_dim(x, 0, n, axis=ax) for x, n in zip(xs, sizes)], axis=ax)
    pad = [(0, 0)] * x.ndim
    pad[ax] = (0, size - x.shape[ax])
    return jnp.pad(x, pad)


# ---------------------------------------------------------------------------------------------
# Whole parameter trees
# ---------------------------------------------------------------------------------------------


def is_projection_kernel(path: tuple[str, ...], leaf: Any) -> bool:
    """Default `quantize_params` predicate: a 2-D "kernel" under an attention / MLP projection."""
    return (bool(path) and path[-1] == "kernel" and getattr(leaf, "ndim", 0) == 2
            and any(p in DEFAULT_PROJECTIONS for p in path[:-1]))


LM_HEAD_PATH = ("lm_head", "kernel")


def is_lm_head_kernel(path: tuple[str, ...], leaf: Any) -> bool:
    """The untied LM head's [hidden, vocab] kernel. Quantized only when asked (`quantize_lm_head`):
    a tied model has no such leaf (its head is `embed_tokens.attend`, the embedding table, which is
    never quantized), so asking changes nothing there."""
    return tuple(path[-2:]) == LM_HEAD_PATH and getattr(leaf, "ndim", 0) == 2


def quantization_predicate(quantize_lm_head: bool = False,
                           base: Callable[[tuple[str, ...], Any], bool] = is_projection_kernel,
                           ) -> Callable[[tuple[str, ...], Any], bool]:
    """What is quantized: `base` (default: the linear projections), and the untied LM head when asked."""
    if not quantize_lm_head:
        return base
    return lambda path, leaf: base(path, leaf) or is_lm_head_kernel(path, leaf)


_warned_tied_lm_head = False


def warn_if_tied_lm_head(cfg: Any, quantize_lm_head: bool) -> bool:
    """Logs once per process that `quantize_lm_head` does nothing for a model with tied embeddings
    (its LM head is the embedding table, which stays in the engine dtype). True when it applies."""
    global _warned_tied_lm_head
    if not (quantize_lm_head and getattr(cfg, "tie_word_embeddings", False)):
        return False
    if not _warned_tied_lm_head:
        _warned_tied_lm_head = True
        logging.getLogger(__name__).warning(
            "quantize_lm_head: this model ties its LM head to the token embedding (tie_word_embeddings), "
            "so there is no separate LM head to quantize; the embedding table stays unquantized")
    return True


def quantize_params(
    params: Mapping[str, Any],
    format: str,
    *,
    include: Callable[[tuple[str, ...], Any], bool] = is_projection_kernel,
    group_size: int | None = None,
    symmetric: bool | None = None,
    quantize_lm_head: bool = False,
) -> dict[str, Any]:
    """Returns a copy of a nested-dict param tree with selected [K, N] kernels quantized.

    Args:
      params: nested dicts of arrays (Flax layout: Dense kernels are [in, out] = [K, N]).
      format, group_size, symmetric: as for `quantize`.
      include: predicate(path, leaf) -> bool; the default takes every 2-D "kernel" under
        q/k/v/o_proj and gate/up/down_proj, never embeddings, nor lm_head unless quantize_lm_head.
      quantize_lm_head: also quantize the untied LM head (`lm_head/kernel`, [hidden, vocab]).
        Tied embeddings are never quantized: a tied model has no lm_head leaf, so this is a no-op
        there. The embedding table is never quantized.
    """
    return map_params(params, leaf_quantizer(format, include=include, group_size=group_size, symmetric=symmetric,
                                             quantize_lm_head=quantize_lm_head))


def leaf_quantizer(format: str, *, include: Callable[[tuple[str, ...], Any], bool] = is_projection_kernel,
                   group_size: int | None = None, symmetric: bool | None = None,
                   quantize_lm_head: bool = False) -> Callable[[tuple[str, ...], Any], Any]:
    """`quantize_params` for one leaf: fn(path, leaf) -> the leaf, quantized if selected (same args)."""
    include = quantization_predicate(quantize_lm_head, include)
    return lambda path, leaf: (quantize(leaf, format, group_size=group_size, symmetric=symmetric)
                               if include(path, leaf) else leaf)


def map_params(params: Mapping[str, Any], fn: Callable[[tuple[str, ...], Any], Any]) -> dict[str, Any]:
    """A copy of a nested-dict param tree with each leaf replaced by fn(path, leaf)."""
    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping):
            return {key: walk(value, path + (str(key),)) for key, value in node.items()}
        return fn(path, node)
    return walk(params, ())


def with_activations(params: Any, activations: str) -> tuple[Any, int]:
    """(params with every per-channel weight of format `activations` ("fp8" or "int8": W8A8 for
    products of many rows, pallas_kernels/w8a8.py) set to take them, how many weights that is). Other
    weights are left as they are. The arrays are shared, not copied."""
    count = 0

    def set_activations(leaf):
        nonlocal count
        if isinstance(leaf, QuantizedWeight) and is_per_channel(leaf) and leaf.format == activations:
            count += 1
            return dataclasses.replace(leaf, activations=activations)
        return leaf
    params = jax.tree_util.tree_map(set_activations, params,
                                    is_leaf=lambda n: isinstance(n, QuantizedWeight))
    return params, count

"""What a loaded parameter tree holds, by storage format: the line the engine logs at start-up.

llama.cpp users read "type q4_K: 193 tensors" when a file loads; here the same question is which
format each weight runs in on the device (a GGUF's Q6_K becomes int8 with groups of 32, say) and
how many bytes that takes, since a decode step reads all of them.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import numpy as np

from models.layers import is_quantized
from pallas_kernels.quant_format import ARRAY_FIELDS


FOUR_BIT = ("int4", "uint4", "float4_e2m1fn")   # two values per byte on the device


def nbytes(leaf) -> int:
    """Device bytes of an array (4-bit dtypes packed two per byte)."""
    dtype = np.dtype(leaf.dtype)
    return leaf.size // 2 if dtype.name in FOUR_BIT else leaf.size * dtype.itemsize


def weight_nbytes(w) -> int:
    """Device bytes of one weight: an array, or a QuantizedWeight's codes and group rows."""
    parts = [getattr(w, f) for f in ARRAY_FIELDS] if is_quantized(w) else [w]
    return sum(nbytes(p) for p in parts if p is not None)


def format_name(w) -> str:
    """"int4 g32 offsets", "int8 per channel", "fp8 g128", "int4 g128 zero points", "int4 g32/256
    offsets" (two-level group rows: groups of 32 under super-groups of 256), "fp8 per channel (fp8
    activations)" (W8A8 past pallas_kernels/w8a8.py's MIN_ROWS; int8 alike), or a float dtype."""
    if not is_quantized(w):
        return np.dtype(w.dtype).name
    per_channel = w.num_groups == 1
    kind = "" if w.zeros is None else (" zero points" if w.zero_point else " offsets")
    groups = f"g{w.group_size}" + (f"/{w.super_group}" if w.two_level else "")
    acts = f" ({w.activations} activations)" if w.activations != "bf16" else ""
    return f"{w.format} {'per channel' if per_channel else groups}{kind}{acts}"


def summarize(params: Any) -> dict[str, tuple[int, int]]:
    """format name -> (number of tensors, bytes on the device) over the tree (all shards of a
    sharded array; a quantized weight counts its codes and group rows)."""
    counts, sizes = Counter(), Counter()
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_quantized):
        name = format_name(leaf)
        counts[name] += 1
        sizes[name] += weight_nbytes(leaf)
    return {name: (counts[name], sizes[name]) for name in sorted(sizes, key=sizes.get, reverse=True)}


def describe(params: Any) -> str:
    """One line: "weights 6.41 GB: int4 g32 offsets 3.73 GB (192 tensors), int8 g32 1.63 GB (33 tensors), ..."."""
    summary = summarize(params)
    total = sum(b for _, b in summary.values())
    parts = [f"{name} {_size(b)} ({n} tensor{'s' if n != 1 else ''})" for name, (n, b) in summary.items()]
    return f"weights {_size(total)}: " + ", ".join(parts)


def _size(b: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b} B"

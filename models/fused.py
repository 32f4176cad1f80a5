"""Fused projections: q/k/v as one `qkv_proj` matmul and gate/up as one `gate_up_proj` matmul.

Checkpoints, loading and tensor-parallel placement keep Hugging Face's per-projection layout
(q_proj, k_proj, v_proj, gate_proj, up_proj); the runner executes the fused layout, built once
from the loaded params (`fuse_projections`) and split again for saving (`unfuse_projections`).
One matmul per group reads the same bytes in one larger kernel instead of two or three (decode is
a stream over the weights, and small k/v matrices do not fill the GPU alone).

Under tensor parallelism each device concatenates its own column shards, so the global fused
matrix is shard-interleaved ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...]) and its ordinary split over the
mesh gives every device exactly its parts. Quantized weights fuse along N with their scales;
parts of different kinds (a GGUF file mixing block types, say) stay unfused, and the model runs
either layout per layer.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from atlasjax.quantization import ARRAY_FIELDS, concat_quantized, n_axis, padded_sizes
from models.layers import is_quantized

# (module, fused name, parts in output order)
GROUPS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
          ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def fuse_projections(params: dict, mesh=None, axis: str = "model", *, in_place: bool = False) -> dict:
    """The param tree with each layer's groups fused where their parts are compatible.

    mesh: the tensor-parallel mesh when params are sharded over `axis` (None on one device).
    in_place: fuse inside the given dicts, so each layer's separate arrays are freed as soon as
    its fused ones exist (peak memory: one layer's projections, not all of them); otherwise the
    given tree is left as it was.
    """
    out = params if in_place else dict(params)
    for name in [k for k in params if k.startswith("layers_")]:
        layer = out[name] if in_place else dict(out[name])
        for module, fused, parts in GROUPS:
            mod = layer[module] if in_place else dict(layer[module])
            if all(p in mod for p in parts) and _compatible([mod[p] for p in parts]):
                mod[fused] = {key: _concat([mod[p][key] for p in parts], mesh, axis) for key in mod[parts[0]]}
                for p in parts:
                    del mod[p]
            layer[module] = mod
        out[name] = layer
    return out


def unfuse_projections(params: dict, widths: dict[str, tuple[int, ...]], mesh=None, axis: str = "model") -> dict:
    """The per-projection tree again. widths: fused name -> global widths of its parts, e.g.
    {"qkv_proj": (q, k, v), "gate_up_proj": (i, i)} (each split evenly over the mesh)."""
    out = dict(params)
    shards = 1 if mesh is None else mesh.shape[axis]
    for name in [k for k in params if k.startswith("layers_")]:
        layer = dict(params[name])
        for module, fused, parts in GROUPS:
            mod = dict(layer[module])
            if fused in mod:
                local = [w // shards for w in widths[fused]]
                pieces = {key: _split(leaf, local, mesh, axis) for key, leaf in mod.pop(fused).items()}
                for i, p in enumerate(parts):
                    mod[p] = {key: pieces[key][i] for key in pieces}
            layer[module] = mod
        out[name] = layer
    return out


def fuse_logical_axes(logical: dict, params: dict) -> dict:
    """The logical-axes tree matching a (partly) fused param tree: a fused group takes its first part's axes."""
    out = dict(logical)
    for name in [k for k in params if k.startswith("layers_")]:
        layer = dict(logical[name])
        for module, fused, parts in GROUPS:
            if fused in params[name][module]:
                mod = {k: v for k, v in layer[module].items() if k not in parts}
                mod[fused] = layer[module][parts[0]]
                layer[module] = mod
        out[name] = layer
    return out


def _compatible(parts: list[dict]) -> bool:
    if any(set(p) != set(parts[0]) for p in parts):   # all with bias or none
        return False
    kernels = [p["kernel"] for p in parts]
    if all(is_quantized(k) for k in kernels):
        first = kernels[0]
        return all(k.format == first.format and k.group_size == first.group_size and k.shape[0] == first.shape[0]
                   and k.qweight.shape[-1] == first.qweight.shape[-1] and (k.zeros is None) == (first.zeros is None)
                   and k.zero_point == first.zero_point and k.mma_order == first.mma_order
                   and k.two_level == first.two_level for k in kernels)
    return (not any(is_quantized(k) for k in kernels)
            and all(k.dtype == kernels[0].dtype and k.shape[0] == kernels[0].shape[0] for k in kernels))


def _concat(leaves, mesh, axis):
    if is_quantized(leaves[0]):
        return concat_quantized(leaves, dim=1)   # stacked per-device weights: each device's own, too
    if mesh is None:
        return jnp.concatenate(leaves, axis=-1)
    return _local_concat(mesh, axis, leaves[0].ndim, len(leaves))(*leaves)


def _split(leaf, local_widths, mesh, axis):
    if is_quantized(leaf):
        return _split_quantized(leaf, local_widths)
    cuts = tuple(itertools.accumulate(local_widths))[:-1]
    if mesh is None:
        return jnp.split(leaf, cuts, axis=-1)
    return _local_split(mesh, axis, leaf.ndim, cuts)(leaf)


@functools.cache
def _local_concat(mesh, axis, ndim, n):
    spec = P(*([None] * (ndim - 1)), axis)   # column shards: each device concatenates its own
    return jax.jit(jax.shard_map(lambda *xs: jnp.concatenate(xs, axis=-1), mesh=mesh, in_specs=(spec,) * n,
                                 out_specs=spec))


@functools.cache
def _local_split(mesh, axis, ndim, cuts):
    spec = P(*([None] * (ndim - 1)), axis)
    return jax.jit(jax.shard_map(lambda x: tuple(jnp.split(x, cuts, axis=-1)), mesh=mesh, in_specs=spec,
                                 out_specs=(spec,) * (len(cuts) + 1)))


# Quantized weights: qweight [(dev,) N_pad, K_pad], group rows [(dev,) rows, N_pad], logical shape (K, N)
# per device. Stacked per-device weights (tensor parallelism) carry a leading device axis, which
# the ops below leave in place (and sharded).

def _split_quantized(qw, widths):
    k = qw.shape[0]
    n_pads = tuple(padded_sizes(k, w, qw.group_size)[1] for w in widths)

    def split(name):
        leaf = getattr(qw, name)
        return [None] * len(widths) if leaf is None else _split_n(leaf, widths=tuple(widths), n_axis=n_axis(name),
                                                                  n_pads=n_pads)
    pieces = {name: split(name) for name in ARRAY_FIELDS}
    return [dataclasses.replace(qw, shape=(k, w), **{name: pieces[name][i] for name in ARRAY_FIELDS})
            for i, w in enumerate(widths)]


@functools.partial(jax.jit, static_argnames=("widths", "n_axis", "n_pads"))
def _split_n(x, widths, n_axis, n_pads):
    ax = x.ndim + n_axis
    starts = (0, *itertools.accumulate(widths))
    return tuple(_pad_to(jax.lax.slice_in_dim(x, s, s + w, axis=ax), p, ax) for s, w, p in zip(starts, widths, n_pads))


def _pad_to(x, size, ax):
    pad = [(0, 0)] * x.ndim
    pad[ax] = (0, size - x.shape[ax])
    return jnp.pad(x, pad)

"""How a model runs when each device holds a shard of it (inside `shard_map`), without naming the mesh.

`Parallel.rules` maps the logical axes that are split to the mesh axis that splits them (built by
atlasjax/sharding.py from its rules table). The model asks four questions of it:
- a matmul that contracts over a split axis (row-parallel: o_proj, down_proj) holds partial sums:
  `reduce` all-reduces them (one psum per row-parallel projection);
- a result split over its last axis that must be whole (the vocab-parallel LM head): `gather`;
- an embedding lookup into a vocab-split table: `embed` looks up the local rows and all-reduces;
- how many shards an axis has (`shards`), to split a fused projection's local output.
With no rules (one device) every method is the identity, so single-device code pays nothing.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Parallel:
    rules: tuple[tuple[str, str], ...] = ()   # (logical axis, mesh axis) for every split axis

    def mesh_axis(self, logical: str | None) -> str | None:
        return dict(self.rules).get(logical)

    def shards(self, logical: str) -> int:
        """How many devices split the logical axis (1 when it is whole)."""
        axis = self.mesh_axis(logical)
        return 1 if axis is None else jax.lax.axis_size(axis)

    def reduce(self, y: jax.Array, contracted: str) -> jax.Array:
        """All-reduce partial sums of a matmul that contracted over the (split) `contracted` axis."""
        axis = self.mesh_axis(contracted)
        return y if axis is None else jax.lax.psum(y, axis)

    def gather(self, y: jax.Array, logical: str) -> jax.Array:
        """Concatenate the shards of y's last axis (split as `logical`) on every device."""
        axis = self.mesh_axis(logical)
        return y if axis is None else jax.lax.all_gather(y, axis, axis=y.ndim - 1, tiled=True)

    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """Rows of a [vocab, embed] table; with vocab split, each device serves the ids it holds."""
        axis = self.mesh_axis("vocab")
        if axis is None:
            return jnp.take(table, tokens, axis=0)
        rows = table.shape[0]
        local = tokens - jax.lax.axis_index(axis) * rows
        mine = (local >= 0) & (local < rows)
        x = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0) * mine[:, None].astype(table.dtype)
        return jax.lax.psum(x, axis)   # exactly one device contributes each row

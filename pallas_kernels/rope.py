"""Rotate-half RoPE inside the decode attention kernel, from tables computed once per step.

Outside a kernel the model applies RoPE in an XLA fusion before attention (models/rope.py
`apply_rope`). In a decode step that fusion is one more kernel per layer between the qkv matmul and
attention; with these pieces the attention kernel reads the raw qkv projections and rotates
q and the new token's k itself (pallas_kernels/paged_attention.py).

`rope_tables(positions, inv_freq, scale)`: [tokens, 2, 2, head_dim] f32, built once per step:
  [t, 0] cos rows: [cos | cos] for K, ones for V;  [t, 1] sin rows: [-sin | sin] for K, zeros for V
  (K's cos and sin times `scale`, yarn's attention factor: models/rope.py).
so the new token's K and V rows, held as x [2, D] with their halves swapped beside them (xs), rotate
as x * cos + xs * sin in one elementwise pass that leaves V exactly as it was. The query tile takes
cos and sin of the first row: its halves are whole shared-memory tiles (head_dim 128 or 256).
"""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_write import as_pool_dtype, saturating_cast

HEAD_DIMS = (128, 256)   # each half of the head is a whole number of 64-column shared-memory tiles


def rope_tables(positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """positions [tokens] int, inv_freq [head_dim // 2] -> [tokens, 2, 2, head_dim] f32 (see above)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos_rows = jnp.stack([jnp.concatenate([cos, cos], -1), jnp.ones_like(cos).repeat(2, -1)], axis=1)
    sin_rows = jnp.stack([jnp.concatenate([-sin, sin], -1), jnp.zeros_like(sin).repeat(2, -1)], axis=1)
    return jnp.stack([cos_rows, sin_rows], axis=1)


def rope_from_tables(x: jax.Array, tables: jax.Array) -> jax.Array:
    """jnp: x [tokens, heads, head_dim] rotated as `apply_rope` does, from `rope_tables`' K rows."""
    half = x.shape[-1] // 2
    cos, sin = tables[:, 0, 0, None, :], tables[:, 1, 0, None, :]
    xf = x.astype(jnp.float32)
    swapped = jnp.concatenate([xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + swapped * sin).astype(x.dtype)


def rotate_query_tile(q_smem, tables_smem, rows: int, out_smem=None):
    """In a kernel: the first `rows` rows of q_smem ([64, head_dim], tiled (8, 64) and swizzled, as
    the wgmma reads it) rotated in place, or into out_smem (same shape and tiling; f16 saturates at
    its largest value). tables_smem: one token's `rope_tables` entry [2, 2, D]."""
    out_smem = q_smem if out_smem is None else out_smem
    half = q_smem.shape[-1] // 2
    cos = tables_smem.at[0, 0, pl.ds(0, half)][...][:, None]
    sin = tables_smem.at[1, 0, pl.ds(half, half)][...][:, None]
    # Transposed, so that a head-dim element is a row of the wgmma layout and cos / sin broadcast
    # along the query rows.
    lo = q_smem.at[pl.ds(0, rows), pl.ds(0, half)].T
    hi = q_smem.at[pl.ds(0, rows), pl.ds(half, half)].T
    x1 = plgpu.load(lo, layout=plgpu.Layout.WGMMA_TRANSPOSED).astype(jnp.float32)
    x2 = plgpu.load(hi, layout=plgpu.Layout.WGMMA_TRANSPOSED).astype(jnp.float32)
    def cast(y):
        return y.astype(out_smem.dtype) if out_smem.dtype == q_smem.dtype else saturating_cast(y, out_smem.dtype)
    out_smem.at[pl.ds(0, rows), pl.ds(0, half)].T[...] = cast(x1 * cos - x2 * sin)
    out_smem.at[pl.ds(0, rows), pl.ds(half, half)].T[...] = cast(x2 * cos + x1 * sin)


def load_token_kv(qkv_ref, seq, k_row, v_row, kv_smem, swapped_smem, barrier):
    """In a kernel: TMA the new token's K and V rows of qkv_ref [seqs, rows, D] into kv_smem [2, D],
    and again with their halves swapped into swapped_smem, on `barrier` (LOADS arrivals)."""
    half = kv_smem.shape[-1] // 2
    for dst, src in enumerate((k_row, v_row)):
        row = qkv_ref.at[seq, pl.ds(src, 1)]
        plgpu.copy_gmem_to_smem(row, kv_smem.at[pl.ds(dst, 1)], barrier)
        plgpu.copy_gmem_to_smem(row.at[:, pl.ds(half, half)], swapped_smem.at[pl.ds(dst, 1), pl.ds(0, half)], barrier)
        plgpu.copy_gmem_to_smem(row.at[:, pl.ds(0, half)], swapped_smem.at[pl.ds(dst, 1), pl.ds(half, half)], barrier)


LOADS = 6   # TMA loads of `load_token_kv`


def rotate_token_kv(kv_smem, swapped_smem, tables_smem, pool_rows=None):
    """In a kernel, after `load_token_kv` landed: K rotated in place, V unchanged (cos 1, sin 0).
    pool_rows [2, D] of an fp8 pool's dtype: the rows go there instead, rounded first to bf16 (the
    model's K/V, as the XLA path writes them) and then to fp8, saturating."""
    x = kv_smem[...].astype(jnp.float32) * tables_smem.at[0][...]
    x = x + swapped_smem[...].astype(jnp.float32) * tables_smem.at[1][...]
    if pool_rows is None:
        kv_smem[...] = x.astype(kv_smem.dtype)
    else:
        pool_rows[...] = as_pool_dtype(x.astype(jnp.bfloat16), pool_rows.dtype)

"""Writing a step's K/V into the paged pool: in jnp (XLA turns it into an in-place scatter), and
from inside a Mosaic GPU kernel (`store_token_kv`).

Pool layout: k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]. A token's flat slot is
`page * page_size + offset`; slot >= num_pages * page_size means "write nothing" (padding tokens).
"""
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.words import from_words, packs, to_words


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def saturating_cast(x, dtype):
    """x in the float `dtype`, values past its largest finite one clamped to it (computed in f32; in
    jnp or inside a Mosaic GPU kernel). e4m3fn has no infinity: a plain cast of a larger value is NaN."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32), -top, top).astype(dtype)


def as_pool_dtype(x, dtype):
    """K/V values in the pool's dtype: fp8 saturates (`saturating_cast`); values are stored unscaled,
    as vLLM does with its default scales of 1.0."""
    return saturating_cast(x, dtype) if is_fp8(dtype) else x.astype(dtype)


def _scatter_rows(pages, rows, slot_mapping):
    """rows [kv_heads, tokens, W] into their slots of pages [kv_heads, num_pages, page_size, W]."""
    kvh, num_pages, page_size, _ = pages.shape
    flat = pages.reshape(kvh, num_pages * page_size, -1).at[:, slot_mapping].set(rows, mode="drop")
    return flat.reshape(kvh, num_pages, page_size, -1)


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter K/V [num_tokens, kv_heads, head_dim] into their slots, in place when the pool is donated.
    Rows move as uint32 words (pallas_kernels/words.py): half (bf16) or a quarter (fp8) of the elements."""
    def write(pages, x):
        rows = as_pool_dtype(x.swapaxes(0, 1), pages.dtype)   # [kv_heads, tokens, head_dim]
        if not packs(rows):
            return _scatter_rows(pages, rows, slot_mapping)
        return from_words(_scatter_rows(to_words(pages), to_words(rows), slot_mapping), pages.dtype)

    return write(k_pages, k), write(v_pages, v)


def decode_slots(page_table, seq_lens, page_size: int, num_pages: int):
    """The slot of each decode token: position seq_lens - 1 through the page table; inactive
    slots (seq_lens == 0) get the out-of-range slot, so nothing is written for them."""
    positions = jnp.maximum(seq_lens - 1, 0)
    pages = jnp.take_along_axis(page_table, (positions // page_size)[:, None], axis=1)[:, 0]
    return jnp.where(seq_lens > 0, pages * page_size + positions % page_size, num_pages * page_size)


def store_token_kv(load_rows, k_ref, v_ref, table_ref, seq, kv_head, pos, *, num_loads: int = 1):
    """In a Mosaic GPU kernel: one token's K and V rows into the page slot of position `pos` of
    sequence `seq`, waiting until the stores have landed. `load_rows(rows, bar)` issues the
    `num_loads` TMA loads (on barrier `bar`) that put K in row 0 and V in row 1 of `rows`, a
    [2, head_dim] shared-memory tile."""
    def copy(rows, bar):
        load_rows(rows, bar)
        plgpu.barrier_wait(bar)
        store_token_rows(rows, k_ref, v_ref, table_ref, seq, kv_head, pos)
    pl.run_scoped(copy, plgpu.SMEM((2, k_ref.shape[-1]), k_ref.dtype),
                  plgpu.Barrier(num_arrivals=num_loads, num_barriers=1))


def store_token_rows(rows, k_ref, v_ref, table_ref, seq, kv_head, pos, *, wait: bool = True):
    """In a Mosaic GPU kernel: rows [2, head_dim] (shared memory: K, then V) into the page slot of
    position `pos` of sequence `seq`; with `wait`, until the stores have landed (else the caller
    waits: `plgpu.wait_smem_to_gmem(0)`)."""
    num_pages, page_size = k_ref.shape[1:3]
    page = jnp.clip(table_ref[seq, pos // page_size], 0, num_pages - 1)
    row = pl.ds(lax.rem(pos, page_size), 1)
    plgpu.copy_smem_to_gmem(rows.at[pl.ds(0, 1)], k_ref.at[kv_head, page, row])
    plgpu.copy_smem_to_gmem(rows.at[pl.ds(1, 1)], v_ref.at[kv_head, page, row])
    if wait:
        plgpu.wait_smem_to_gmem(0)

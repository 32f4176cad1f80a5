"""Writing a step's K/V into the paged pool (jnp; XLA turns it into an in-place scatter).

Pool layout: k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]. A token's flat slot is
`page * page_size + offset`; slot >= num_pages * page_size means "write nothing" (padding tokens).
"""
import jax.numpy as jnp


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter K/V [num_tokens, kv_heads, head_dim] into their slots, in place when the pool is donated."""
    kvh, num_pages, page_size, hd = k_pages.shape
    flat_k = k_pages.reshape(kvh, num_pages * page_size, hd)
    flat_v = v_pages.reshape(kvh, num_pages * page_size, hd)
    flat_k = flat_k.at[:, slot_mapping].set(k.swapaxes(0, 1).astype(k_pages.dtype), mode="drop")
    flat_v = flat_v.at[:, slot_mapping].set(v.swapaxes(0, 1).astype(v_pages.dtype), mode="drop")
    return flat_k.reshape(k_pages.shape), flat_v.reshape(v_pages.shape)


def decode_slots(page_table, seq_lens, page_size: int, num_pages: int):
    """The slot of each decode token: position seq_lens - 1 through the page table; inactive
    slots (seq_lens == 0) get the out-of-range slot, so nothing is written for them."""
    positions = jnp.maximum(seq_lens - 1, 0)
    pages = jnp.take_along_axis(page_table, (positions // page_size)[:, None], axis=1)[:, 0]
    return jnp.where(seq_lens > 0, pages * page_size + positions % page_size, num_pages * page_size)

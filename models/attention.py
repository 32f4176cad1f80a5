"""Attention over the paged KV cache: metadata, the KV write, and the one kernel dispatch point.

Page pool layout per layer: k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]
(what the Pallas kernels read fastest: one kv head's page is a contiguous [page_size, head_dim]
tile). A token's flat slot is `page * page_size + offset`; slot >= num_pages * page_size means
"write nothing" (padding tokens).
"""
from __future__ import annotations

import flax.struct
import jax

from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.ragged_attention import ragged_paged_attention


@flax.struct.dataclass
class AttentionMetadata:
    """Explicit per-step attention metadata (small int32 arrays built by the host).

    Decode steps: one query token per sequence slot, query_start is None.
    Prefill (ragged) steps: packed tokens of several sequences, sequence s owns rows
    query_start[s]:query_start[s+1] and sits at the end of its seq_lens[s] context.
    """
    slot_mapping: jax.Array              # [num_tokens] flat cache slot for each token's K/V
    page_table: jax.Array                # [num_seqs, pages_per_seq]
    seq_lens: jax.Array                  # [num_seqs] context length incl. this step's tokens; 0 = inactive
    query_start: jax.Array | None = None  # [num_seqs + 1] (prefill only)
    num_seqs: jax.Array | None = None     # [] int32 (prefill only)

    @property
    def is_decode(self) -> bool:
        return self.query_start is None


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter this step's K/V into the pages in place (the pool is donated to the step).

    k_pages: [kv_heads, num_pages, page_size, head_dim]; k: [num_tokens, kv_heads, head_dim].
    """
    kvh, num_pages, page_size, hd = k_pages.shape
    flat_k = k_pages.reshape(kvh, num_pages * page_size, hd)
    flat_v = v_pages.reshape(kvh, num_pages * page_size, hd)
    flat_k = flat_k.at[:, slot_mapping].set(k.swapaxes(0, 1).astype(k_pages.dtype), mode="drop")
    flat_v = flat_v.at[:, slot_mapping].set(v.swapaxes(0, 1).astype(v_pages.dtype), mode="drop")
    return flat_k.reshape(k_pages.shape), flat_v.reshape(v_pages.shape)


def attention(q, k_pages, v_pages, meta: AttentionMetadata, *, backend: str = "auto"):
    """The dispatch point: Pallas kernels on GPU, jnp references elsewhere (or as forced).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]
    """
    if meta.is_decode:
        return paged_decode_attention(q, k_pages, v_pages, meta.page_table, meta.seq_lens, backend=backend)
    return ragged_paged_attention(q, k_pages, v_pages, meta.page_table, meta.seq_lens, meta.query_start,
                                  meta.num_seqs, backend=backend)

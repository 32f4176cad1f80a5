"""Attention over the paged KV cache: metadata, the KV write, and the one kernel dispatch point.

Page pool layout per layer: k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]
(what the Pallas kernels read fastest: one kv head's page is a contiguous [page_size, head_dim]
tile). A token's flat slot is `page * page_size + offset`; slot >= num_pages * page_size means
"write nothing" (padding tokens).
"""
from __future__ import annotations

import os

import flax.struct
import jax

from models import reference
from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import (paged_decode_attention, paged_decode_attention_and_write,
                                            paged_decode_attention_rope_and_write)
from pallas_kernels.ragged_attention import ragged_paged_attention


@flax.struct.dataclass
class AttentionMetadata:
    """Explicit per-step attention metadata (small int32 arrays built by the host).

    Decode steps: one query token per sequence slot, query_start is None.
    Prefill (ragged) steps: packed tokens of several sequences, sequence s owns rows
    query_start[s]:query_start[s+1] and sits at the end of its seq_lens[s] context.
    """
    slot_mapping: jax.Array              # [num_tokens] flat cache slot for each token's K/V (prefill writes
                                         # there; a decode token goes to position seq_lens - 1 of its pages)
    page_table: jax.Array                # [num_seqs, pages_per_seq]
    seq_lens: jax.Array                  # [num_seqs] context length incl. this step's tokens; 0 = inactive
    query_start: jax.Array | None = None  # [num_seqs + 1] (prefill only)
    num_seqs: jax.Array | None = None     # [] int32 (prefill only)
    # Decode only, static: the rows the attention kernel sizes its context splits for (default: every
    # row). The engine's long-context decode programs pass fewer, or a fraction of one for more than one
    # wave of splits (atlasjax/long_context_decode.py TIERS).
    split_rows: float | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def is_decode(self) -> bool:
        return self.query_start is None


def attention(q, k_pages, v_pages, meta: AttentionMetadata, *, backend: str = "auto"):
    """The dispatch point: Pallas kernels on GPU, jnp references elsewhere (or as forced).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]
    """
    backend = reference.attention_backend(backend)
    if meta.is_decode:
        return paged_decode_attention(q, k_pages, v_pages, meta.page_table, meta.seq_lens, backend=backend,
                                      split_rows=meta.split_rows)
    return ragged_paged_attention(q, k_pages, v_pages, meta.page_table, meta.seq_lens, meta.query_start,
                                  meta.num_seqs, backend=backend)


def write_and_attend(q, k, v, kv, meta: AttentionMetadata, *, backend: str = "auto"):
    """Write this step's K/V into the pool, then attend: (out, (k_pages, v_pages)).

    Decode steps hand both to the decode attention entry, whose GPU kernel writes the new token's
    K/V row itself (two scatter kernels fewer per layer); prefill chunks scatter, then attend (a
    chunk attends to itself too).
    """
    backend = reference.attention_backend(backend)
    if meta.is_decode:
        out, k_pages, v_pages = paged_decode_attention_and_write(q, k, v, *kv, meta.page_table, meta.seq_lens,
                                                                 backend=backend, split_rows=meta.split_rows)
        return out, (k_pages, v_pages)
    k_pages, v_pages = write_kv(*kv, k, v, meta.slot_mapping)
    return attention(q, k_pages, v_pages, meta, backend=backend), (k_pages, v_pages)


def rope_in_kernel() -> bool:
    """Whether decode steps hand the raw qkv projections to the attention kernel, which applies RoPE
    itself (pallas_kernels/rope.py); `ATLASJAX_ATTENTION_ROPE=off` rotates them in XLA first, for
    A/B measurements."""
    return os.environ.get("ATLASJAX_ATTENTION_ROPE", "").lower() not in ("off", "0", "false")


def rope_write_and_attend(qkv, tables, kv, meta: AttentionMetadata, *, num_heads: int, backend: str = "auto"):
    """A decode step's `write_and_attend` from the raw projections qkv [seqs, (num_heads + 2 kv_heads)
    * head_dim] and `rope_tables(positions, inv_freq)`: RoPE, the K/V write and attention in the
    kernel where it can (`can_fuse_rope`), else rotated first, with the same result."""
    backend = reference.attention_backend(backend)
    out, k_pages, v_pages = paged_decode_attention_rope_and_write(qkv, tables, *kv, meta.page_table, meta.seq_lens,
                                                                  num_heads=num_heads, backend=backend,
                                                                  split_rows=meta.split_rows)
    return out, (k_pages, v_pages)

"""Causal prefill attention of packed (ragged) query chunks over a paged KV cache.

Owns `ragged_paged_attention`: the queries of several sequences are packed along one token axis
(query_start gives each sequence's rows); each chunk's tokens sit at the end of its sequence's
context and attend causally to every earlier position (prefix-cache hits, earlier chunks).

Pallas path (Mosaic GPU), data flow:
  q [tokens, heads, D] -> regrouped into 64-row query tiles per KV head: a tile holds
     64 // group consecutive tokens of ONE sequence x the group query heads of one KV head,
     so K/V are read once per group and no tile straddles two sequences
  -> kernel grid (kv_heads, tiles): pages of the tile's sequence stream through shared memory
     (TMA, `num_stages` deep); S = Q K^T and O += P V on wgmma, causal mask, online softmax (f32)
  -> output tiles are gathered back to the packed [tokens, heads, D] layout.
The regroup/ungather are two small XLA gathers over q and out (not over K/V).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.online_softmax import (KV_DTYPES, as_compute_dtype, attend_kv_blocks, fetch_kv_block,
                                           kv_pipeline_scratch, resolve_interpret)
from pallas_kernels.words import as_words

_ROWS = 64  # wgmma M
_LOG2E = math.log2(math.e)


def _ragged_kernel(q_ref, k_ref, v_ref, table_ref, meta_ref, o_ref, *, group, page_size,
                   block_kv, num_stages, sm_scale, p_in_smem):
  """One program: one KV head x one query tile (rows = tokens x heads of one sequence)."""
  kv_head, tile = lax.axis_index("kv_heads"), lax.axis_index("tiles")
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype   # f16 over fp8 pages
  pages_per_block = block_kv // page_size
  seq, q_pos0, kv_len = meta_ref[tile, 0], meta_ref[tile, 1], meta_ref[tile, 2]
  num_steps = pl.cdiv(kv_len, block_kv)
  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def attend(q_smem, **scratch):
    def fetch(step, slot):
      fetch_kv_block(k_ref, v_ref, table_ref, seq, kv_head, step * pages_per_block, slot,
                     *(scratch[n] for n in ("k_smem", "v_smem", "k_bars", "v_bars")), pages_per_block=pages_per_block)
    # Row r is token r // group of the tile; its position bounds what it may see.
    row = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
    q_pos = q_pos0 + lax.div(row, jnp.int32(group))
    col = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)

    def causal(step, s):
      kv_pos = step * block_kv + col
      # Position 0 is visible to every row, so the first step leaves every m_i finite.
      return jnp.where((kv_pos <= q_pos) & (kv_pos < kv_len), s, -jnp.inf)
    # Blocks wholly below the tile's first position need no causal mask: skip its ALU work.
    full_steps = jnp.clip((q_pos0 + 1) // block_kv, 0, num_steps)
    return attend_kv_blocks(q_smem, scratch, fetch, causal, num_steps=num_steps,
                            num_stages=num_stages, scale=sm_scale * _LOG2E, block_kv=block_kv, rows=_ROWS,
                            head_dim=head_dim, unmasked_steps=full_steps)

  def body(q_smem, q_bar):
    @pl.when(num_steps > 0)
    def _():
      plgpu.copy_gmem_to_smem(q_ref.at[kv_head, tile], q_smem, q_bar)
      plgpu.barrier_wait(q_bar)

    acc, _, l_i = pl.run_scoped(
        functools.partial(attend, q_smem),
        **kv_pipeline_scratch(num_stages, block_kv, head_dim, k_ref.dtype, transforms, pages_per_block, _ROWS,
                              p_in_smem),
    )
    out = acc / lax.broadcast_in_dim(jnp.maximum(l_i, 1e-30), acc.shape, [0])
    q_smem[...] = out.astype(q_smem.dtype)  # q is consumed: reuse its tile for the output
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[kv_head, tile])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(body, plgpu.SMEM((_ROWS, head_dim), dtype, transforms=transforms),
                plgpu.Barrier(num_barriers=1))


def _tile_plan(query_start, seq_lens, num_seqs, num_tokens, tile_tokens):
  """Per-tile metadata and the token <-> (tile, row) maps, all small int32 jnp arrays."""
  max_seqs = query_start.shape[0] - 1
  max_tiles = pl.cdiv(num_tokens, tile_tokens) + max_seqs
  used = jnp.arange(max_seqs) < num_seqs
  q_len = jnp.where(used, query_start[1:] - query_start[:-1], 0)
  tiles_per_seq = pl.cdiv(q_len, tile_tokens)
  tile_end = jnp.cumsum(tiles_per_seq)
  tile_start = tile_end - tiles_per_seq
  t = jnp.arange(max_tiles)
  seq = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), max_seqs - 1)
  live = t < tile_end[-1]
  tok0 = (t - tile_start[seq]) * tile_tokens  # first token of the tile within its chunk
  count = jnp.clip(q_len[seq] - tok0, 0, tile_tokens)
  q_pos0 = seq_lens[seq] - q_len[seq] + tok0
  kv_len = jnp.where(live, jnp.minimum(seq_lens[seq], q_pos0 + count), 0)
  meta = jnp.stack([seq, q_pos0, kv_len], axis=1).astype(jnp.int32)
  # Packed token index of each tile row (rows past the chunk read a valid dummy token).
  tok = query_start[seq][:, None] + tok0[:, None] + jnp.arange(tile_tokens)[None, :]
  tok = jnp.where(jnp.arange(tile_tokens)[None, :] < count[:, None], tok, 0)
  # Inverse map: tile and first row of each packed token.
  i = jnp.arange(num_tokens)
  tok_seq = jnp.minimum(jnp.searchsorted(query_start[1:], i, side="right"), max_seqs - 1)
  local = i - query_start[tok_seq]
  tok_tile = tile_start[tok_seq] + local // tile_tokens
  tok_valid = i < query_start[num_seqs]
  return meta, jnp.clip(tok, 0, num_tokens - 1), tok_tile, local % tile_tokens, tok_valid


def _ragged_pallas(q, k_pages, v_pages, page_table, seq_lens, query_start, num_seqs, *,
                   sm_scale, block_kv, num_stages, interpret):
  num_tokens, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  tile_tokens = _ROWS // group
  meta, tok, tok_tile, tok_row, tok_valid = _tile_plan(
      query_start, seq_lens, num_seqs, num_tokens, tile_tokens)
  max_tiles = meta.shape[0]
  # [kv_heads, tiles, 64, D]: row = token_in_tile * group + head_in_group.
  # Both regroupings move whole head_dim rows: as uint32 words (pallas_kernels/words.py), half the elements.
  def regroup(qg):
    q_tiles = qg[tok].transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, max_tiles, tile_tokens * group, -1)
    return jnp.pad(q_tiles, ((0, 0), (0, 0), (0, _ROWS - tile_tokens * group), (0, 0)))
  qg = as_compute_dtype(q, k_pages.dtype).reshape(num_tokens, num_kv_heads, group, head_dim)
  q_tiles = as_words(regroup, qg)
  max_blocks = pl.cdiv(page_table.shape[1] * page_size, block_kv)
  pages_needed = max_blocks * (block_kv // page_size)
  table = jnp.pad(page_table, ((0, 0), (0, max(0, pages_needed - page_table.shape[1]))))

  def ragged_paged_attention_kernel(*refs):  # named so profiles are readable
    _ragged_kernel(*refs, group=group, page_size=page_size, block_kv=block_kv,
                   num_stages=num_stages, sm_scale=sm_scale, p_in_smem=bool(interpret))
  o_tiles = plgpu.kernel(
      ragged_paged_attention_kernel,
      out_type=jax.ShapeDtypeStruct((num_kv_heads, max_tiles, _ROWS, head_dim), q_tiles.dtype),
      grid=(num_kv_heads, max_tiles), grid_names=("kv_heads", "tiles"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(q_tiles, k_pages, v_pages, table, meta)
  rows = tok_row[:, None] * group + jnp.arange(group)[None, :]  # [tokens, group]

  def ungroup(o_tiles):
    out = o_tiles[:, tok_tile[:, None], rows]  # [kv_heads, tokens, group, D]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, -1)
    return jnp.where(tok_valid[:, None, None], out, 0)
  return as_words(ungroup, o_tiles).astype(q.dtype)


def can_use_pallas(q, k_pages):
  """Whether the Pallas kernel supports these shapes and dtypes (else use the reference)."""
  num_heads, head_dim = q.shape[-2:]
  num_kv_heads, _, page_size, _ = k_pages.shape
  return (k_pages.dtype in KV_DTYPES and head_dim in (64, 128, 256)
          and num_heads // num_kv_heads <= _ROWS and page_size % 8 == 0 and page_size <= 256)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "backend", "interpret", "block_kv", "num_stages"))
def ragged_paged_attention(q, k_pages, v_pages, page_table, seq_lens, query_start, num_seqs, *,
                           sm_scale=None, backend="auto", interpret=False, block_kv=None,
                           num_stages=None):
  """Causal attention of packed query chunks over their sequences' pages.

  Args:
    q: [num_tokens, num_heads, head_dim] packed queries; rows past query_start[num_seqs] are pad.
    k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim], bf16/f16 or fp8 (e4m3 / e5m2,
      read as f16; f32: reference).
    page_table: [max_seqs, pages_per_seq] int32.
    seq_lens: [max_seqs] int32 context lengths, the chunk's own tokens included.
    query_start: [max_seqs + 1] int32 cumulative query offsets.
    num_seqs: int32 scalar or [1] array; sequences >= num_seqs are unused.
    sm_scale: softmax scale, default head_dim ** -0.5.
    backend: "pallas", "reference", "auto" (Pallas on GPU when the shapes allow it), or
      "interpret" (the Pallas kernel in interpret mode).
    interpret: Pallas interpret mode (e.g. `plgpu.InterpretGPUParams()`), for CPU tests.
    block_kv, num_stages: tunables (KV tokens per step, pipeline depth).
  Returns:
    [num_tokens, num_heads, head_dim] in q.dtype; zeros on padding rows.
  """
  num_tokens, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  max_seqs = query_start.shape[0] - 1
  if k_pages.shape != v_pages.shape or k_pages.shape[-1] != head_dim:
    raise ValueError(f"bad KV shapes {k_pages.shape=} {v_pages.shape=} for {q.shape=}")
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads=} is not a multiple of {num_kv_heads=}")
  if page_table.shape[0] != max_seqs or seq_lens.shape != (max_seqs,):
    raise ValueError(f"bad metadata {page_table.shape=} {seq_lens.shape=} for {max_seqs=}")
  num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0]
  query_start, seq_lens = query_start.astype(jnp.int32), seq_lens.astype(jnp.int32)
  sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  if backend == "auto":
    use_pallas = jax.default_backend() == "gpu" and can_use_pallas(q, k_pages)
    backend = "pallas" if use_pallas else "reference"
  backend, interpret = resolve_interpret(backend, interpret)
  if backend == "reference":
    return ragged_paged_attention_reference(q, k_pages, v_pages, page_table, seq_lens,
                                            query_start, num_seqs, sm_scale=sm_scale)
  if backend != "pallas":
    raise ValueError(f"unknown {backend=}")
  if not can_use_pallas(q, k_pages):
    raise ValueError(f"Pallas ragged does not support {q.shape=} {k_pages.shape=} {k_pages.dtype}")
  block_kv = block_kv or max(page_size, 64)
  if block_kv % page_size or block_kv > 256:
    raise ValueError(f"{block_kv=} must be a multiple of {page_size=} and at most 256")
  num_stages = num_stages or 2  # H100 sweep: 2 stages 417 us vs 3-4 stages 594 us (1x4096)
  return _ragged_pallas(q, k_pages, v_pages, page_table.astype(jnp.int32), seq_lens,
                        query_start, num_seqs, sm_scale=sm_scale, block_kv=block_kv,
                        num_stages=num_stages, interpret=interpret)


def ragged_paged_attention_reference(q, k_pages, v_pages, page_table, seq_lens, query_start,
                                     num_seqs, *, sm_scale=None):
  """Plain-jnp ragged causal attention in f32.

  Loops over sequences with fori_loop: each iteration gathers one sequence's pages
  ([kv_heads, context, D]), attends all packed rows to it, and keeps that sequence's rows, so
  memory is O(num_tokens x context) for scores, never a per-token K/V gather. The loop runs the
  page table's rows (a static count, so reverse-mode differentiation works: atlasjax/forward.py)
  and skips those past num_seqs.
  """
  num_tokens, num_heads, head_dim = q.shape  # [num_tokens, num_heads, head_dim]
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  ctx = page_table.shape[1] * page_size
  num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0]
  qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
  rows = jnp.arange(num_tokens)

  def one_seq(s, out):
    return lax.cond(s < num_seqs, attend_seq, lambda s, out: out, s, out)

  def attend_seq(s, out):
    start, end = query_start[s], query_start[s + 1]
    k = k_pages[:, page_table[s]].reshape(num_kv_heads, ctx, head_dim).astype(jnp.float32)
    v = v_pages[:, page_table[s]].reshape(num_kv_heads, ctx, head_dim).astype(jnp.float32)
    q_pos = seq_lens[s] - (end - start) + (rows - start)  # [num_tokens]
    visible = jnp.arange(ctx)[None, :] <= q_pos[:, None]  # [num_tokens, ctx]
    sc = jnp.einsum("thgd,hkd->thgk", qg, k, precision=lax.Precision.HIGHEST)
    sc = jnp.where(visible[:, None, None, :], sc, -jnp.inf)
    m = jnp.max(sc, axis=-1, keepdims=True)
    p = jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("thgk,hkd->thgd", p / jnp.where(l > 0, l, 1.0), v,
                   precision=lax.Precision.HIGHEST)
    mine = (rows >= start) & (rows < end)
    return jnp.where(mine[:, None, None, None], o, out)

  out = lax.fori_loop(0, page_table.shape[0], one_seq, jnp.zeros_like(qg))
  return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)

"""Decode attention over a paged KV cache (Pallas, Mosaic GPU backend).

Owns `paged_decode_attention`: one new query token per sequence attends to every token its page
table points at. Data flow of the Pallas path:

  q [seqs, heads, D] -> grouped per KV head, padded to a multiple of 8 rows, loaded into the first
     rows of a 64-row wgmma tile in shared memory (the rest is never read back: rows are independent)
  -> kernel grid (kv_heads, splits, seqs): each program streams the pages of one split of one
     sequence's context (its seq_len divided evenly, block-aligned) through shared memory (TMA,
     `num_stages` deep), computes S = Q K^T and O += P V with wgmma and an online softmax in f32
  -> one split: normalized output; several splits (flash-decoding, when few sequences leave SMs
     idle): per-split normalized partials + base-2 logsumexp, merged by a small jnp combine.

KV layout (fixed, the model code depends on it): k_pages, v_pages are
[num_kv_heads, num_pages, page_size, head_dim]; token j of sequence s lives in page
page_table[s, j // page_size], row j % page_size. seq_lens[s] == 0 marks an inactive slot: its
programs issue no K/V loads and its output is zeros.

`paged_decode_attention_and_write` also writes the new token's K/V (position seq_lens - 1) into the
pool: the two rows ride in the last two rows of the q tile, and the program whose split
holds that position copies them into their page (TMA, through shared memory) before it streams
its pages. The decode step then needs one XLA fusion (split-K sum, RoPE, padding) before the
kernel instead of three. The pools are passed as mutable refs (`jax.new_ref`), which the kernel
call aliases in place.

`paged_decode_attention_rope_and_write` takes the raw qkv projections and RoPE tables instead
(session 25): the kernel loads each KV head's query rows straight from the projections, rotates
them and the new K in shared memory (pallas_kernels/rope.py), and the decode step needs no XLA
kernel before attention at all. On the H100 the 8B bs=1 step went from 3.297 to 3.257 ms (fp8),
the attention kernel from 4.64 to 5.09 us per layer, one 1.6 us fusion fewer.

fp8 pools (`--kv-cache-dtype fp8`, session 48): each K/V block is converted to f16 in shared memory
(online_softmax.py) and the products run in f16. The RoPE entry rounds the new K/V rows to the
pool's fp8 in registers and converts q to f16 as it rotates it; the prepared-tile entry leaves the
write to an XLA scatter.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import rope
from pallas_kernels.kv_write import decode_slots, is_fp8, store_token_kv, store_token_rows, write_kv
from pallas_kernels.online_softmax import (KV_DTYPES, as_compute_dtype, attend_kv_blocks, compute_dtype,
                                           fetch_kv_block, kv_pipeline_scratch, positions_before, resolve_interpret)

_ROWS = 64  # wgmma M: the query heads of one KV head fill the first rows of one 64-row tile
_MAX_GROUP_WRITING = _ROWS - 2   # the new token's K and V take two more rows of that tile
_LOG2E = math.log2(math.e)
_NUM_SMS = 132   # H100 SXM: one wave of programs


def _decode_kernel(q_ref, rope_ref, k_ref, v_ref, table_ref, lens_ref, o_ref, lse_ref, *, page_size, block_kv,
                   num_splits, num_stages, sm_scale, p_in_smem, writes, num_heads=None, tile_rows=None):
  """One program: one KV head x one split of the context x one sequence. Its query heads' `q_rows`
  rows (a multiple of 8; o_ref and lse_ref have as many) are stored back from its 64-row wgmma tile,
  of which only the first `tile_rows` are loaded.

  rope_ref None: q_ref holds the prepared tiles [seqs, kv_heads, q_rows, D] (tile_rows = q_rows):
  the query heads, then padding; with `writes` the last two rows hold the new token's K and V,
  written into k_ref / v_ref first.
  rope_ref [seqs, 2, 2, D] (pallas_kernels/rope.py): q_ref is the raw projections [seqs, num_heads +
  2 kv_heads, D]. The tile is the `tile_rows` rows from the multiple of 8 at or before the KV head's
  first query head (other heads' rows around them are discarded as padding is), rotated in shared
  memory; the new K is rotated before it is written. The query heads' rows are stored from where
  they start in the tile, so the outputs have the prepared tiles' layout. Over fp8 pools the
  projections stay in the model's dtype: the tile is loaded into a scratch of that dtype and rotated
  into the f16 q tile (no XLA conversion before the kernel)."""
  kv_head, split, seq = (lax.axis_index(n) for n in ("kv_heads", "splits", "seqs"))
  q_rows, head_dim = o_ref.shape[-2:]
  num_kv_heads = k_ref.shape[0]
  dtype = compute_dtype(k_ref.dtype)   # the q tile's and the products' (f16 over fp8 pages)
  pages_per_block = block_kv // page_size
  seq_len = lens_ref[seq]
  # The sequence's own context (not the page table's width) is shared evenly by the splits, so
  # a short sequence in a long table still spreads over all of them.
  split_len = pl.cdiv(pl.cdiv(seq_len, block_kv), num_splits) * block_kv
  start = split * split_len
  end = jnp.minimum(seq_len, start + split_len)
  num_steps = jnp.maximum(pl.cdiv(end - start, block_kv), 0)
  pos = seq_len - 1   # the new token's
  # The split that holds the new token's position writes its K/V, before any of its page loads.
  writer = (seq_len > 0) & (pos >= start) & (pos < start + split_len)
  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  if rope_ref is None:
    q_tile, tile_rows, row0 = q_ref.at[seq, kv_head], q_rows, 0
  else:   # a tiled TMA load starts at a multiple of 8 rows
    first_head = kv_head * (num_heads // num_kv_heads)
    first_row = pl.multiple_of(lax.div(first_head, 8) * 8, 8)
    q_tile, row0 = q_ref.at[seq, pl.ds(first_row, tile_rows)], first_head - first_row

  def attend(q_smem, **scratch):
    def fetch(step, slot):
      fetch_kv_block(k_ref, v_ref, table_ref, seq, kv_head, (start + step * block_kv) // page_size, slot,
                     *(scratch[n] for n in ("k_smem", "v_smem", "k_bars", "v_bars")), pages_per_block=pages_per_block)
    return attend_kv_blocks(q_smem, scratch, fetch,
                            positions_before(end, start, block_kv, _ROWS), num_steps=num_steps,
                            num_stages=num_stages, scale=sm_scale * _LOG2E, block_kv=block_kv, rows=_ROWS,
                            head_dim=head_dim)

  def write_new_token():
    """Copy the new token's K and V rows (the q tile's last two) into their page, waiting until
    the stores have landed."""
    def load(rows, bar):
      plgpu.copy_gmem_to_smem(q_ref.at[seq, kv_head, pl.ds(q_rows - 2, 2)], rows, bar)
    pl.when(writer)(lambda: store_token_kv(load, k_ref, v_ref, table_ref, seq, kv_head, pos))

  def rotate_and_write_new_token(q_in, q_smem, q_bar, tables_smem, tables_bar, kv_smem, swapped_smem, kv_bar,
                                 pool_rows=None):
    """RoPE of the q tile (loaded into q_in, rotated into q_smem: the same buffer unless the
    projections' dtype is not the products') and of the new K; K/V into their page (from `pool_rows`,
    the rows in an fp8 pool's dtype, where given). The K/V loads overlap the q tile's, and their
    stores the q tile's rotation; each barrier is waited on once."""
    if writes:
      pl.when(writer)(lambda: rope.load_token_kv(q_ref, seq, num_heads + kv_head, num_heads + num_kv_heads + kv_head,
                                                 kv_smem, swapped_smem, kv_bar))
    pl.when(num_steps > 0)(lambda: plgpu.barrier_wait(tables_bar))
    if writes:
      @pl.when(writer)
      def _():
        plgpu.barrier_wait(kv_bar)
        rope.rotate_token_kv(kv_smem, swapped_smem, tables_smem, pool_rows)
        plgpu.commit_smem()
        store_token_rows(kv_smem if pool_rows is None else pool_rows, k_ref, v_ref, table_ref, seq, kv_head, pos,
                         wait=False)

    @pl.when(num_steps > 0)
    def _():
      plgpu.barrier_wait(q_bar)
      rope.rotate_query_tile(q_in, tables_smem, tile_rows, out_smem=q_smem)
      plgpu.commit_smem()

    if writes:   # the writer's own pages include the new row: it must have landed
      pl.when(writer)(lambda: plgpu.wait_smem_to_gmem(0))

  def body(q_smem, q_bar, *rope_scratch):
    def load_q(q_in):
      @pl.when(num_steps > 0)
      def _():
        plgpu.copy_gmem_to_smem(q_tile, q_in.at[pl.ds(0, tile_rows)], q_bar)
        if rope_ref is not None:
          plgpu.copy_gmem_to_smem(rope_ref.at[seq], rope_scratch[0], rope_scratch[1])

    if rope_ref is None:
      load_q(q_smem)
      if writes:
        write_new_token()   # overlaps the q load
      pl.when(num_steps > 0)(lambda: plgpu.barrier_wait(q_bar))
    else:
      def load_and_rotate(q_in):
        load_q(q_in)
        rotate_and_write_new_token(q_in, q_smem, q_bar, *rope_scratch)
      if q_ref.dtype == dtype:
        load_and_rotate(q_smem)
      else:   # scoped: its shared memory is free again before the K/V pipeline's
        pl.run_scoped(load_and_rotate, plgpu.SMEM((_ROWS, head_dim), q_ref.dtype, transforms=transforms))

    acc, m_i, l_i = pl.run_scoped(
        functools.partial(attend, q_smem),
        **kv_pipeline_scratch(num_stages, block_kv, head_dim, k_ref.dtype, transforms, pages_per_block, _ROWS,
                              p_in_smem),
    )
    # Inactive or empty splits: acc == 0 and l == 0, so the output is 0 and the lse -inf.
    out = acc / lax.broadcast_in_dim(jnp.maximum(l_i, 1e-30), acc.shape, [0])

    def store(o_smem):
      o_smem[...] = out.astype(o_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(row0, q_rows)], o_ref.at[seq, kv_head, split])
      plgpu.wait_smem_to_gmem(0)
    store_out = functools.partial(pl.run_scoped, store, plgpu.SMEM((_ROWS, head_dim), o_ref.dtype))
    if lse_ref is None:
      store_out()
    else:   # an empty split's partial is skipped by the combine (its lse is -inf): not stored
      pl.when(num_steps > 0)(store_out)

    if lse_ref is not None:
      def store_lse(lse_smem):
        lse_smem[...] = m_i + jnp.log2(l_i)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(row0, q_rows)], lse_ref.at[seq, kv_head, split])
        plgpu.wait_smem_to_gmem(0)
      pl.run_scoped(store_lse, plgpu.SMEM((_ROWS,), jnp.float32))

  rope_scratch = () if rope_ref is None else (
      plgpu.SMEM(rope_ref.shape[1:], jnp.float32), plgpu.Barrier(num_barriers=1),
      plgpu.SMEM((2, head_dim), q_ref.dtype), plgpu.SMEM((2, head_dim), q_ref.dtype),
      plgpu.Barrier(num_arrivals=rope.LOADS, num_barriers=1),
      *([plgpu.SMEM((2, head_dim), k_ref.dtype)] if writes and is_fp8(k_ref.dtype) else []))
  pl.run_scoped(body, plgpu.SMEM((_ROWS, head_dim), dtype, transforms=transforms), plgpu.Barrier(num_barriers=1),
                *rope_scratch)


def _decode_pallas(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale, block_kv,
                   num_splits, num_stages, interpret, new_kv=None, tables=None, num_heads=None):
  """The kernel call: out, or (out, k_pages, v_pages) with the new K/V written when new_kv = (k, v).
  With `tables` (rope.rope_tables), q is the raw projections [seqs, num_heads + 2 kv_heads, D]:
  the kernel rotates q and the new K, and writes K/V too."""
  writes = new_kv is not None or tables is not None
  # fp8 rows are written from the rotated ones only (the RoPE path converts them in registers)
  assert not (new_kv is not None and is_fp8(k_pages.dtype)), "the prepared-tile path writes 16-bit rows only"
  num_seqs, _, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  num_heads = num_heads or q.shape[1]
  group = num_heads // num_kv_heads
  max_blocks = pl.cdiv(page_table.shape[1] * page_size, block_kv)
  num_splits = max(1, min(num_splits, max_blocks))
  num_stages = max(1, min(num_stages, pl.cdiv(max_blocks, num_splits)))
  if tables is None:
    # The query heads of each KV head, padded to a multiple of 8 rows (the tile's TMA granule;
    # the kernel's wgmma tile is 64 rows, but only these are loaded and stored); the new K/V, when
    # written, take the last two rows (their scores are computed and discarded).
    q_rows = pl.cdiv(group + 2 * writes, 8) * 8
    qg = as_compute_dtype(q, k_pages.dtype).reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, q_rows - group - 2 * writes), (0, 0)))
    if writes:
      qg = jnp.concatenate([qg, *(x.astype(qg.dtype)[:, :, None] for x in new_kv)], axis=2)
    inputs = (qg,)
  else:   # the tile is read from the raw projections; its query heads' rows stored as above
    q_rows = pl.cdiv(group, 8) * 8
    # over fp8 pools the kernel converts q itself (as it rotates it): 16-bit projections go in as they are
    keep = is_fp8(k_pages.dtype) and q.dtype in (jnp.bfloat16, jnp.float16)
    inputs = (q if keep else q.astype(jnp.bfloat16 if is_fp8(k_pages.dtype) else k_pages.dtype),
              tables.astype(jnp.float32))
  # The page table is padded so the last block's page lookups stay in bounds.
  pages_needed = max_blocks * (block_kv // page_size)
  table = jnp.pad(page_table, ((0, 0), (0, max(0, pages_needed - page_table.shape[1]))))
  split_out = num_splits > 1
  out_type = [jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_splits, q_rows, head_dim),
                                   jnp.float32 if split_out else q.dtype)]
  if split_out:
    out_type.append(jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_splits, q_rows), jnp.float32))

  def paged_decode_attention_kernel(*refs):  # named so profiles are readable
    refs = refs if tables is not None else (refs[0], None, *refs[1:])
    refs = refs if split_out else (*refs, None)
    _decode_kernel(*refs, page_size=page_size, block_kv=block_kv, num_splits=num_splits,
                   num_stages=num_stages, sm_scale=sm_scale, p_in_smem=bool(interpret), writes=writes,
                   num_heads=num_heads, tile_rows=None if tables is None else _rope_tile_rows(group, num_kv_heads))
  call = plgpu.kernel(
      paged_decode_attention_kernel, out_type=out_type, grid=(num_kv_heads, num_splits, num_seqs),
      grid_names=("kv_heads", "splits", "seqs"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )
  if writes:
    k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)   # written in place by the kernel
    outs = call(*inputs, k_ref, v_ref, table, seq_lens)
    k_pages, v_pages = jax.freeze(k_ref), jax.freeze(v_ref)
  else:
    outs = call(*inputs, k_pages, v_pages, table, seq_lens)
  if split_out:
    out = _combine_splits(*outs, group)
  else:
    out = outs[0][:, :, 0, :group]
  out = out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
  return (out, k_pages, v_pages) if writes else out


def _rope_row_offsets(group, num_kv_heads):
  """Reading the raw projections, KV head h's tile starts at the multiple of 8 at or before its
  first query head (row h * group): its query heads start at row offsets[h] of the tile."""
  return tuple(h * group % 8 for h in range(num_kv_heads))


def _rope_tile_rows(group, num_kv_heads):
  """The rows of the query tile read from the raw projections: every KV head's query heads."""
  return max(pl.cdiv(r + group, 8) * 8 for r in _rope_row_offsets(group, num_kv_heads))


def _combine_splits(out, lse, group):
  """Merges the per-split partials: out [..., splits, rows, D] f32 normalized, lse [..., splits, rows]
  base 2 -> [..., group, D]. An empty split (lse -inf) has no stored partial and weighs nothing."""
  out, lse = out[..., :group, :], lse[..., :group]
  lse_max = lse.max(axis=-2, keepdims=True)
  weights = jnp.exp2(lse - jnp.where(jnp.isfinite(lse_max), lse_max, 0.0))
  denom = jnp.maximum(weights.sum(axis=-2), 1e-30)
  out = jnp.where(weights[..., None] > 0, out * weights[..., None], 0.0)
  return out.sum(axis=-3) / denom[..., None]


_FRACTION_KV_HEADS = 8


def _default_num_splits(num_seqs, num_kv_heads, max_blocks, num_sms=_NUM_SMS):
  """About one wave of programs (measured best on H100 for 1 x 32k: 16 splits over 8 KV heads) over
  num_seqs rows, at most one per block of the page table. A fraction of a row f: 1/f times the splits of
  one row of 8 KV heads, whatever the model's heads (past 48k tokens the split's length, not the count of
  programs, set the speed: 4 KV heads took 66 splits a row as well as 8 did; H200, session 70)."""
  heads = _FRACTION_KV_HEADS if num_seqs < 1 else num_kv_heads
  want = math.ceil(num_sms / (num_seqs * heads))
  return max(1, min(want, max_blocks))


def can_use_pallas(q, k_pages):
  """Whether the Pallas kernel supports these shapes and dtypes (else use the reference)."""
  num_heads, head_dim = q.shape[-2:]
  num_kv_heads, _, page_size, _ = k_pages.shape
  return (k_pages.dtype in KV_DTYPES and head_dim in (64, 128, 256)
          and num_heads // num_kv_heads <= _ROWS and page_size % 8 == 0 and page_size <= 256)


_STATIC = ("sm_scale", "backend", "interpret", "block_kv", "num_splits", "num_stages", "split_rows")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale=None,
                           backend="auto", interpret=False, block_kv=None, num_splits=None,
                           num_stages=None, split_rows=None):
  """Attention of one query token per sequence over its pages.

  Args:
    q: [num_seqs, num_heads, head_dim] queries (any float dtype).
    k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim], bf16/f16 or fp8 (e4m3 / e5m2,
      read as f16; f32: reference).
    page_table: [num_seqs, pages_per_seq] int32 page ids.
    seq_lens: [num_seqs] int32 context lengths (new token included); 0 = inactive slot.
    sm_scale: softmax scale, default head_dim ** -0.5.
    backend: "pallas", "reference", "auto" (Pallas on GPU when the shapes allow it), or
      "interpret" (the Pallas kernel in interpret mode).
    interpret: Pallas interpret mode (e.g. `plgpu.InterpretGPUParams()`), for CPU tests.
    block_kv, num_splits, num_stages: tunables (KV tokens per step, context splits, pipeline
      depth); defaults chosen from the shapes.
    split_rows: the rows the default context splits are sized for (one wave of programs over them;
      default num_seqs). A step with few active rows among many passes their count, so a lone long
      context is not split as if every row were busy; a fraction (0.25: four waves for one row) splits
      a very long context finer still.
  Returns:
    [num_seqs, num_heads, head_dim] in q.dtype; zeros for inactive slots.
  """
  backend, interpret = resolve_interpret(backend, interpret)
  plan = _plan(q, k_pages, v_pages, page_table, seq_lens, sm_scale, backend, block_kv, num_splits, num_stages,
               split_rows)
  if plan is None:
    return paged_decode_attention_reference(q, k_pages, v_pages, page_table, seq_lens,
                                            sm_scale=sm_scale)
  return _decode_pallas(q, k_pages, v_pages, page_table.astype(jnp.int32), seq_lens.astype(jnp.int32),
                        interpret=interpret, **plan)


@functools.partial(jax.jit, static_argnames=_STATIC + ("fused_write",))
def paged_decode_attention_and_write(q, k, v, k_pages, v_pages, page_table, seq_lens, *, sm_scale=None,
                                     backend="auto", interpret=False, block_kv=None, num_splits=None,
                                     num_stages=None, split_rows=None, fused_write=True):
  """Writes each sequence's new K/V at position seq_lens - 1 of its pages, then attends as
  `paged_decode_attention` does (the new token included).

  k, v: [num_seqs, num_kv_heads, head_dim]; nothing is written for inactive slots (seq_lens 0).
  fused_write: whether the Pallas kernel writes the rows itself (default; it measured faster than
  an XLA scatter first at every batch size, docs/perf_attention.md) or an XLA scatter runs first.
  Other arguments as for `paged_decode_attention`. Returns (out, k_pages, v_pages); the pools are
  updated in place when the caller donates them.
  """
  backend, interpret = resolve_interpret(backend, interpret)
  plan = _plan(q, k_pages, v_pages, page_table, seq_lens, sm_scale, backend, block_kv, num_splits, num_stages,
               split_rows)
  if k.shape != v.shape or k.shape != (q.shape[0], k_pages.shape[0], k_pages.shape[-1]):
    raise ValueError(f"bad new K/V shapes {k.shape=} {v.shape=} for {q.shape=} {k_pages.shape=}")
  group = q.shape[1] // k_pages.shape[0]
  # The prepared tile's rows are copied as they are: fp8 pools take the XLA scatter (it rounds and
  # saturates). The RoPE entry's kernel writes fp8 rows itself.
  if plan is None or not fused_write or group > _MAX_GROUP_WRITING or is_fp8(k_pages.dtype):
    _, num_pages, page_size, _ = k_pages.shape
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, decode_slots(page_table, seq_lens, page_size, num_pages))
    out = paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, sm_scale=sm_scale, backend=backend,
                                 interpret=interpret, block_kv=block_kv, num_splits=num_splits,
                                 num_stages=num_stages, split_rows=split_rows)
    return out, k_pages, v_pages
  return _decode_pallas(q, k_pages, v_pages, page_table.astype(jnp.int32), seq_lens.astype(jnp.int32),
                        interpret=interpret, new_kv=(k, v), **plan)


def can_fuse_rope(num_heads, k_pages, head_dim):
  """Whether the kernel can read the raw projections and rotate them itself: each half of a head a
  whole shared-memory tile; the projection rows whole tiles of 8 (the tiled TMA load's); every KV
  head's query tile inside them; and its query heads' rows stored from a 16-byte aligned row of
  the f32 lse (groups of a multiple of 4 query heads: Llama 3's 8B and 70B, not 3B's 3)."""
  num_kv_heads = k_pages.shape[0]
  group = num_heads // num_kv_heads
  offsets = _rope_row_offsets(group, num_kv_heads)
  tile_rows = _rope_tile_rows(group, num_kv_heads)
  return (head_dim in rope.HEAD_DIMS and (num_heads + 2 * num_kv_heads) % 8 == 0
          and (num_kv_heads - 1) * group - offsets[-1] + tile_rows <= num_heads + 2 * num_kv_heads
          and all(r % 4 == 0 for r in offsets) and max(offsets) + pl.cdiv(group, 8) * 8 <= _ROWS)


@functools.partial(jax.jit, static_argnames=_STATIC + ("num_heads",))
def paged_decode_attention_rope_and_write(qkv, tables, k_pages, v_pages, page_table, seq_lens, *, num_heads,
                                          sm_scale=None, backend="auto", interpret=False, block_kv=None,
                                          num_splits=None, num_stages=None, split_rows=None):
  """RoPE, the K/V write and attention of a decode step from the raw projections.

  qkv: [num_seqs, (num_heads + 2 num_kv_heads) * head_dim], q | k | v as the fused qkv matmul
  gives them; tables: `rope.rope_tables(positions, inv_freq)` [num_seqs, 2, 2, head_dim].
  Equivalent to rotating q and k as models/rope.py `apply_rope` does and calling
  `paged_decode_attention_and_write`; on the Pallas path where `can_fuse_rope` holds, the kernel
  does the rotation itself (one XLA fusion fewer before it per layer). Returns (out [num_seqs,
  num_heads, head_dim], k_pages, v_pages).
  """
  num_seqs = qkv.shape[0]
  head_dim = k_pages.shape[-1]
  num_kv_heads = k_pages.shape[0]
  if qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim or tables.shape != (num_seqs, 2, 2, head_dim):
    raise ValueError(f"bad projections or RoPE tables {qkv.shape=} {tables.shape=} for {num_heads=} {k_pages.shape=}")
  qkv = qkv.reshape(num_seqs, -1, head_dim)
  backend, interpret = resolve_interpret(backend, interpret)
  q, k, v = jnp.split(qkv, [num_heads, num_heads + num_kv_heads], axis=1)
  plan = _plan(q, k_pages, v_pages, page_table, seq_lens, sm_scale, backend, block_kv, num_splits, num_stages,
               split_rows)
  if plan is None or not can_fuse_rope(num_heads, k_pages, head_dim):
    q, k = rope.rope_from_tables(q, tables), rope.rope_from_tables(k, tables)
    return paged_decode_attention_and_write(q, k, v, k_pages, v_pages, page_table, seq_lens, sm_scale=sm_scale,
                                            backend=backend, interpret=interpret, block_kv=block_kv,
                                            num_splits=num_splits, num_stages=num_stages, split_rows=split_rows)
  return _decode_pallas(qkv, k_pages, v_pages, page_table.astype(jnp.int32), seq_lens.astype(jnp.int32),
                        interpret=interpret, tables=tables, num_heads=num_heads, **plan)


def _plan(q, k_pages, v_pages, page_table, seq_lens, sm_scale, backend, block_kv, num_splits, num_stages,
          split_rows):
  """Validates the shapes; None for the reference backend, else the Pallas kernel's settings."""
  num_seqs, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  if k_pages.shape != v_pages.shape or k_pages.shape[-1] != head_dim:
    raise ValueError(f"bad KV shapes {k_pages.shape=} {v_pages.shape=} for {q.shape=}")
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads=} is not a multiple of {num_kv_heads=}")
  if page_table.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
    raise ValueError(f"bad metadata {page_table.shape=} {seq_lens.shape=} for {num_seqs=}")
  if backend == "auto":
    use_pallas = jax.default_backend() == "gpu" and can_use_pallas(q, k_pages)
    backend = "pallas" if use_pallas else "reference"
  if backend == "reference":
    return None
  if backend != "pallas":
    raise ValueError(f"unknown {backend=}")
  if not can_use_pallas(q, k_pages):
    raise ValueError(f"Pallas decode does not support {q.shape=} {k_pages.shape=} {k_pages.dtype}")
  block_kv = block_kv or max(page_size, 64)
  if block_kv % page_size or block_kv > 256:
    raise ValueError(f"{block_kv=} must be a multiple of {page_size=} and at most 256")
  max_blocks = pl.cdiv(page_table.shape[1] * page_size, block_kv)
  return dict(sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale, block_kv=block_kv,
              num_splits=num_splits or _default_num_splits(split_rows or num_seqs, num_kv_heads, max_blocks),
              num_stages=num_stages or 2)  # H100 sweep: 2 stages beat 3-4 (two programs fit per SM)


def paged_decode_attention_reference(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale=None):
  """Plain-jnp decode attention in f32: gathers each sequence's pages, masks past seq_len.

  Memory: one gathered copy of the page-table-sized context per sequence (what XLA fuses it into).
  """
  num_seqs, num_heads, head_dim = q.shape  # [num_seqs, num_heads, head_dim]
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  ctx = page_table.shape[1] * page_size

  def one_seq(q_s, pages, length):
    k = k_pages[:, pages].reshape(num_kv_heads, ctx, head_dim).astype(jnp.float32)
    v = v_pages[:, pages].reshape(num_kv_heads, ctx, head_dim).astype(jnp.float32)
    qg = q_s.reshape(num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
    s = jnp.einsum("hgd,hkd->hgk", qg, k, precision=lax.Precision.HIGHEST)
    s = jnp.where(jnp.arange(ctx) < length, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("hgk,hkd->hgd", p, v, precision=lax.Precision.HIGHEST)
    o = o / jnp.where(l > 0, l, 1.0)
    return o.reshape(num_heads, head_dim)

  out = lax.map(lambda args: one_seq(*args), (q, page_table, seq_lens))
  return out.astype(q.dtype)

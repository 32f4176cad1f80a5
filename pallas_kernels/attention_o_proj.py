"""Decode attention + o_proj in one kernel (Pallas, Mosaic GPU). EXPERIMENTAL: correct on the H100,
but measured slower than the three kernels it would replace, so the model does not use it (session
10 in docs/performance.md: bs=1, 200-token context, 33 us against 22; `notebooks/gpu_attention_o_proj.py`).

The idea: at bs=1 the decode attention kernel (a few us, HBM idle), its split combine and the o_proj
GEMM (a ramp-bound ~13 us stream of a 32 MB weight) run back to back. Here each program owns one KV
head and one group of o_proj's output columns, issues the loads of its weight slice first, then
computes its head's attention while they land, and multiplies:

  tile [M, kv_heads, 24, D]   rows 0..group-1: the head group's (RoPE'd) queries; row 8: the new
                              token's K; row 16: its V; other rows zero (`pack_decode_tile`)
  grid (kv_heads, column groups); program (h, c):
    1. TMA: W[h*group*D : (h+1)*group*D, c*cols : (c+1)*cols] in `w_stages` stages of `tile_k` rows
    2. for each sequence: online-softmax attention of head group h over the cached tokens
       (positions < seq_len - 1, from the pages) plus the new token (its score is column 8 of
       Q @ Q^T, the tile's rows being in the Q tile; its value is row 8 of a tile holding the
       tile's rows 8..23), so no program reads a page slot written in this launch; programs of
       column group 0 write the new K/V into the pages
    3. the attention rows (one per query head) go to a private scratch row [group * D] (the
       regrouping of heads into columns, through global memory: L2), come back as the A operand
       [rows, group*D] of a wgmma against the weight stages
  -> partials [kv_heads, M_pad, N] f32, for the caller to sum over KV heads (XLA would fuse the
     sum into the residual add, as it fuses o_proj's own split-K sum).

Why it loses: next to the attention's buffers a program's shared memory holds only 3 of its 8
weight stages, so most of the weight streams after the attention; and one program walks its
head's whole context serially, where the decode kernel spreads it over ~16 splits. What could
rescue it: the column-group programs of a head each take one split of the context and exchange
their partials through global memory with a grid-level wait (all 128 programs are resident on
132 SMs), which Mosaic GPU's global semaphores allow but its interpret mode cannot run.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_write import decode_slots, store_token_kv, write_kv
from pallas_kernels.online_softmax import (attend_kv_blocks, fetch_kv_block, kv_pipeline_scratch,
                                           online_softmax_update, positions_before, pv_product)
from pallas_kernels.paged_attention import paged_decode_attention_reference

_ROWS = 64            # wgmma M
_TILE_ROWS = 24       # q rows 0..7, K row 8, V row 16
_K_ROW, _V_ROW = 8, 16
_LOG2E = math.log2(math.e)
_SMEM = 227 * 1024


def pack_decode_tile(q, k, v):
    """q [M, heads, D], k, v [M, kv_heads, D] -> the kernel's tile [M, kv_heads, 24, D]."""
    m, heads, d = q.shape
    kvh = k.shape[1]
    if heads // kvh > _K_ROW:
        raise ValueError(f"unsupported shapes: {heads // kvh} query heads per KV head (at most {_K_ROW})")
    qg = q.reshape(m, kvh, heads // kvh, d)
    zeros = functools.partial(jnp.zeros, dtype=q.dtype)
    return jnp.concatenate([qg, zeros((m, kvh, _K_ROW - heads // kvh, d)), k[:, :, None].astype(q.dtype),
                            zeros((m, kvh, _V_ROW - _K_ROW - 1, d)), v[:, :, None].astype(q.dtype),
                            zeros((m, kvh, _TILE_ROWS - _V_ROW - 1, d))], axis=2)


def _smem_bytes(head_dim, group, block_kv, kv_stages, tile_k, w_stages, cols, interpret):
    w = w_stages * tile_k * cols * 2
    attn = 3 * _ROWS * head_dim * 2 + 2 * kv_stages * block_kv * head_dim * 2
    attn += _ROWS * (block_kv + _ROWS) * 2 if interpret else 0
    gemm = max(_ROWS * group * head_dim * 2, _ROWS * cols * 4)
    return w + max(attn, gemm) + 1024


def _kernel(tile_ref, w_ref, table_ref, lens_ref, k_ref, v_ref, out_ref, scratch_ref, *, page_size,
            block_kv, kv_stages, tile_k, w_stages, sm_scale, p_in_smem):
    h, c = lax.axis_index("kv_heads"), lax.axis_index("cols")
    num_seqs = tile_ref.shape[0]
    rows_pad = scratch_ref.shape[2]
    head_dim = tile_ref.shape[-1]
    group_d = scratch_ref.shape[-1]
    group = group_d // head_dim
    n_cols = out_ref.shape[-1] // scratch_ref.shape[1]   # output columns per program
    dtype = w_ref.dtype
    num_k_steps = group_d // tile_k
    pages_per_block = block_kv // page_size
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def body(w_smem, w_bars):
        def fetch_w(step, slot):
            plgpu.copy_gmem_to_smem(
                w_ref.at[pl.ds(h * group_d + step * tile_k, tile_k), pl.ds(c * n_cols, n_cols)],
                w_smem.at[slot], w_bars.at[slot])
        for s in range(min(w_stages, num_k_steps)):   # the weight stream starts before any attention
            fetch_w(s, s)

        @pl.loop(0, num_seqs)
        def _(seq):
            _attend_one(seq)

        def gemm(a_smem, a_bar):
            plgpu.copy_gmem_to_smem(scratch_ref.at[h, c], a_smem.at[pl.ds(0, rows_pad)], a_bar.at[0])
            plgpu.barrier_wait(a_bar.at[0])

            def product(acc_ref):
                @pl.loop(0, num_k_steps)
                def _(step):
                    slot = lax.rem(step, w_stages)
                    plgpu.barrier_wait(w_bars.at[slot])
                    plgpu.wgmma(acc_ref, a_smem.at[:, pl.ds(step * tile_k, tile_k)], w_smem.at[slot])
                    plgpu.wgmma_wait(0)
                    nxt = step + w_stages
                    pl.when(nxt < num_k_steps)(functools.partial(fetch_w, nxt, slot))
                return acc_ref[...]
            return pl.run_scoped(product, plgpu.ACC((_ROWS, n_cols), jnp.float32))
        acc = pl.run_scoped(gemm, plgpu.SMEM((_ROWS, group_d), dtype, transforms=transforms),
                            plgpu.Barrier(num_barriers=1))

        def store(o_smem):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_pad)], out_ref.at[h, :, pl.ds(c * n_cols, n_cols)])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(store, plgpu.SMEM((_ROWS, n_cols), jnp.float32))

    def _attend_one(seq):
        seq_len = lens_ref[seq]
        cached = jnp.maximum(seq_len - 1, 0)     # the new token comes from the tile, not the pages
        num_steps = pl.cdiv(cached, block_kv)

        def attend(q_smem, new_smem, o_smem, t_bars, k_smem, v_smem, k_bars, v_bars, p_smem=None, p_new_smem=None):
            # new_smem's rows past the tile's must be finite: they meet zero probabilities in P @ V.
            new_smem[...] = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), dtype), plgpu.Layout.WGMMA)
            plgpu.commit_smem()
            plgpu.copy_gmem_to_smem(tile_ref.at[seq, h, pl.ds(0, 16)], q_smem.at[pl.ds(0, 16)], t_bars.at[0])
            plgpu.copy_gmem_to_smem(tile_ref.at[seq, h, pl.ds(_K_ROW, 16)], new_smem.at[pl.ds(0, 16)], t_bars.at[1])
            plgpu.barrier_wait(t_bars.at[0])
            scale = sm_scale * _LOG2E

            def fetch(step, slot):
                fetch_kv_block(k_ref, v_ref, table_ref, seq, h, step * pages_per_block, slot, k_smem, v_smem,
                               k_bars, v_bars, pages_per_block=pages_per_block)
            acc, m_i, l_i = attend_kv_blocks(q_smem, k_smem, v_smem, k_bars, v_bars, p_smem, fetch,
                                             positions_before(cached, 0, block_kv, _ROWS), num_steps=num_steps,
                                             num_stages=kv_stages, scale=scale, block_kv=block_kv, rows=_ROWS,
                                             head_dim=head_dim)

            # The new token: column 8 of Q @ Q^T is q . k_new (the tile's row 8); row 8 of new_smem
            # (the tile's rows 8..23, then zeros) is v_new. wgmma wants K = 64 for P @ V.
            plgpu.barrier_wait(t_bars.at[1])

            def qk_new(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, q_smem.T)
                return acc_ref[...]
            s = pl.run_scoped(qk_new, plgpu.ACC((_ROWS, _ROWS), jnp.float32)) * scale
            col = plgpu.broadcasted_iota(jnp.int32, (_ROWS, _ROWS), 1, layout=plgpu.Layout.WGMMA)
            s = jnp.where(col == _K_ROW, s, -jnp.inf)
            p, _, l_i, acc = online_softmax_update(s, m_i, l_i, acc)
            acc = acc + pv_product(p, new_smem, p_new_smem, _ROWS, head_dim)
            live = (seq_len > 0).astype(jnp.float32)
            out = acc * lax.broadcast_in_dim(live / l_i, acc.shape, [0])
            o_smem[...] = out.astype(dtype)
            plgpu.commit_smem()
            for g in range(group):   # head g's row -> columns g*D.. of this sequence's scratch row
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(g, 1)],
                                        scratch_ref.at[h, c, pl.ds(seq, 1), pl.ds(g * head_dim, head_dim)])
            plgpu.wait_smem_to_gmem(0)

        scratch = kv_pipeline_scratch(kv_stages, block_kv, head_dim, dtype, transforms, pages_per_block, _ROWS,
                                      p_in_smem)
        if p_in_smem:   # interpret mode: wgmma's first operand comes from shared memory
            scratch += (plgpu.SMEM((_ROWS, _ROWS), dtype),)
        pl.run_scoped(attend, plgpu.SMEM((_ROWS, head_dim), dtype, transforms=transforms),
                      plgpu.SMEM((_ROWS, head_dim), dtype, transforms=transforms),
                      plgpu.SMEM((_ROWS, head_dim), dtype), plgpu.Barrier(num_barriers=2), *scratch)

        @pl.when((c == 0) & (seq_len > 0))
        def _():   # the new K/V into their page slot (nobody reads it in this launch)
            def load(rows, bar):   # the tile's K and V rows are not adjacent: two loads
                plgpu.copy_gmem_to_smem(tile_ref.at[seq, h, pl.ds(_K_ROW, 1)], rows.at[pl.ds(0, 1)], bar)
                plgpu.copy_gmem_to_smem(tile_ref.at[seq, h, pl.ds(_V_ROW, 1)], rows.at[pl.ds(1, 1)], bar)
            store_token_kv(load, k_ref, v_ref, table_ref, seq, h, seq_len - 1, num_loads=2)

    pl.run_scoped(body, plgpu.SMEM((w_stages, tile_k, n_cols), dtype, transforms=transforms),
                  plgpu.Barrier(num_barriers=w_stages))


_STATIC = ("sm_scale", "interpret", "block_kv", "kv_stages", "tile_k", "w_stages", "cols")


@functools.partial(jax.jit, static_argnames=_STATIC)
def attention_o_proj_pallas(tile, w, k_pages, v_pages, page_table, seq_lens, *, sm_scale=None, interpret=False,
                            block_kv=64, kv_stages=2, tile_k=64, w_stages=None, cols=256):
    """The kernel: (partials [kv_heads, M_pad, N] f32, k_pages, v_pages, attention rows [M_pad, heads * D])."""
    num_seqs, num_kv_heads, _, head_dim = tile.shape
    _, _, page_size, _ = k_pages.shape
    group_d, n_out = w.shape[0] // num_kv_heads, w.shape[1]
    group = group_d // head_dim
    if group > _K_ROW or head_dim not in (64, 128) or n_out % cols or group_d % tile_k or num_seqs > _ROWS:
        raise ValueError(f"unsupported shapes: {tile.shape=} {w.shape=} {cols=} {tile_k=}")
    rows_pad = pl.cdiv(num_seqs, 8) * 8
    sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    if w_stages is None:   # as many weight stages as shared memory holds, up to the whole slice
        w_stages = group_d // tile_k
        while w_stages > 1 and _smem_bytes(head_dim, group, block_kv, kv_stages, tile_k, w_stages, cols,
                                           bool(interpret)) > _SMEM:
            w_stages -= 1
    block_kv = max(block_kv, page_size)
    pages_needed = pl.cdiv(page_table.shape[1] * page_size, block_kv) * (block_kv // page_size)
    table = jnp.pad(page_table, ((0, 0), (0, max(0, pages_needed - page_table.shape[1]))))
    col_groups = n_out // cols
    out_type = (jax.ShapeDtypeStruct((num_kv_heads, rows_pad, n_out), jnp.float32),
                jax.ShapeDtypeStruct((num_kv_heads, col_groups, rows_pad, group_d), w.dtype))

    def decode_attention_o_proj_kernel(*refs):   # named so profiles are readable
        _kernel(*refs, page_size=page_size, block_kv=block_kv, kv_stages=kv_stages, tile_k=tile_k,
                w_stages=w_stages, sm_scale=sm_scale, p_in_smem=bool(interpret))
    call = plgpu.kernel(decode_attention_o_proj_kernel, out_type=out_type, grid=(num_kv_heads, col_groups),
                        grid_names=("kv_heads", "cols"),
                        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret)
    k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)
    partials, scratch = call(tile, w, table, seq_lens, k_ref, v_ref)
    attn = scratch[:, 0].transpose(1, 0, 2).reshape(rows_pad, num_kv_heads * group_d)
    return partials, jax.freeze(k_ref), jax.freeze(v_ref), attn


def attention_o_proj_reference(q, k, v, w, k_pages, v_pages, page_table, seq_lens, *, sm_scale=None):
    """jnp: write the new K/V, attend (f32), project: (out [M, N] f32, k_pages, v_pages)."""
    _, num_pages, page_size, _ = k_pages.shape
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, decode_slots(page_table, seq_lens, page_size, num_pages))
    attn = paged_decode_attention_reference(q, k_pages, v_pages, page_table, seq_lens, sm_scale=sm_scale)
    out = jnp.dot(attn.reshape(q.shape[0], -1).astype(w.dtype), w, preferred_element_type=jnp.float32)
    return out, k_pages, v_pages

"""The flash-attention pieces shared by the paged decode, ragged prefill and (experimental) decode
attention + o_proj kernels: the K/V page fetch, the online-softmax block loop and its steps.

Scores are in base 2 (the caller folds sm_scale * log2(e) into one multiply); the running row max
`m`, row sum `l` and output accumulator `acc` are f32 registers of a 64-row wgmma tile.
"""
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm_tiling import swizzled
from pallas_kernels.kv_write import is_fp8, saturating_cast

# What the K/V pools may hold. fp8 pages (`--kv-cache-dtype fp8`) are converted to f16 in shared memory
# block by block (e4m3 / e5m2 -> f16 is exact, one cvt per two values), and the products run on f16
# wgmma: q is rounded to f16 (saturating), P is in [0, 1]. On an H200 that measured 4-8% faster than
# converting on to bf16, and loading the fp8 block four values a thread (WGMMA_UPCAST_2X) faster than
# in the wgmma layout (docs/performance.md, session 48).
KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn),
             jnp.dtype(jnp.float8_e5m2))


def compute_dtype(kv_dtype):
    """The dtype of the kernels' q tiles and products over a pool of `kv_dtype`."""
    return jnp.dtype(jnp.float16) if is_fp8(kv_dtype) else jnp.dtype(kv_dtype)


def as_compute_dtype(q, kv_dtype):
    """q for the kernels over a pool of `kv_dtype`: f16 saturates (a bf16 q past 65504 would be inf)."""
    dtype = compute_dtype(kv_dtype)
    return saturating_cast(q, dtype) if is_fp8(kv_dtype) and q.dtype != dtype else q.astype(dtype)


def resolve_interpret(backend: str, interpret):
  """backend "interpret": the Pallas kernel in Mosaic GPU interpret mode (CPU tests of the model)."""
  return ("pallas", plgpu.InterpretGPUParams()) if backend == "interpret" else (backend, interpret)


def online_softmax_update(s, m_i, l_i, acc):
    """One block of scores s [rows, block_kv] -> (p, m_new, l_new, rescaled acc)."""
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p, m_new, l_i, acc


def pv_product(p, v_tile, p_smem, rows: int, head_dim: int):
    """P [rows, block_kv] @ V tile (shared memory) -> [rows, head_dim] f32, with wgmma.

    P stays in registers natively; `p_smem` is given only in interpret mode, whose wgmma reads
    its first operand from shared memory. A fresh accumulator plus a register add (rather than
    run_state on the caller's acc) keeps the kernel runnable in the Mosaic GPU interpreter.
    """
    dtype = v_tile.dtype

    def pv(acc_ref):
        if p_smem is None:
            plgpu.wgmma(acc_ref, p.astype(dtype), v_tile)
        else:
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]
    return pl.run_scoped(pv, plgpu.ACC((rows, head_dim), jnp.float32))


def kv_pipeline_scratch(num_stages: int, block_kv: int, head_dim: int, kv_dtype, transforms, pages_per_block: int,
                        rows: int, p_in_smem: bool) -> dict:
    """Scoped scratch of the K/V pipeline, by the names `attend_kv_blocks` takes (`pl.run_scoped(f,
    **scratch)`): K and V stage buffers [num_stages, block_kv, head_dim] of the pool's dtype, their TMA
    barriers (one arrival per page of a block); with fp8 pages one f16 block each of K and V that
    a stage is converted into (`transforms` are the 16-bit tiles'); and the P tile in shared memory
    where wgmma needs it (interpret mode)."""
    dtype = compute_dtype(kv_dtype)
    stage_transforms = swizzled(head_dim * 8, 8, "K/V pages") if is_fp8(kv_dtype) else transforms
    buffers = plgpu.SMEM((num_stages, block_kv, head_dim), kv_dtype, transforms=stage_transforms)
    barriers = plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages)
    scratch = dict(k_smem=buffers, v_smem=buffers, k_bars=barriers, v_bars=barriers)
    if is_fp8(kv_dtype):
        scratch["k_f16"] = scratch["v_f16"] = plgpu.SMEM((block_kv, head_dim), dtype, transforms=transforms)
    if p_in_smem:
        scratch["p_smem"] = plgpu.SMEM((rows, block_kv), dtype, transforms=transforms)
    return scratch


def _converted(stage, f16_smem):
    """A stage of fp8 K or V, converted into its f16 block for wgmma (or the stage itself). The block
    only passes through registers, so they need not be in the wgmma layout: WGMMA_UPCAST_2X loads four
    fp8 values per 32-bit word."""
    if f16_smem is None:
        return stage
    f16_smem[...] = plgpu.load(stage, layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
    plgpu.commit_smem()   # the wgmma reads it through the async proxy
    return f16_smem


def fetch_kv_block(k_ref, v_ref, table_ref, seq, kv_head, first_page, slot, k_smem, v_smem, k_bars, v_bars, *,
                   pages_per_block: int):
    """TMA: the pages of one K/V block of sequence `seq` (page-table entries first_page..) into stage
    `slot`, one arrival per page on each barrier. Entries past the sequence may hold anything: they
    are clamped to a valid page, and the caller masks their scores."""
    num_pages, page_size = k_ref.shape[1], k_ref.shape[2]
    for i in range(pages_per_block):
        page = jnp.clip(table_ref[seq, first_page + i], 0, num_pages - 1)
        rows = pl.ds(i * page_size, page_size)
        plgpu.copy_gmem_to_smem(k_ref.at[kv_head, page], k_smem.at[slot, rows], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[kv_head, page], v_smem.at[slot, rows], v_bars.at[slot])


def attend_kv_blocks(q_smem, scratch: dict, fetch, mask, *, num_steps, num_stages: int, scale: float, block_kv: int,
                     rows: int, head_dim: int, unmasked_steps=0):
    """Online-softmax attention of the Q tile over `num_steps` K/V blocks, streamed by
    `fetch(step, slot)` through `num_stages` stages of `scratch` (`kv_pipeline_scratch`'s refs).
    Scores are scaled by `scale` (base 2), then `mask(step, s)` hides what a row may not see; steps
    below `unmasked_steps` skip it (blocks the caller knows to be wholly visible). The first masked
    step must leave each row something visible, or be preceded by one that did. Returns the f32
    registers (acc, m, l): acc unnormalized; l == 0 where nothing was visible."""
    k_smem, v_smem, k_bars, v_bars = (scratch[n] for n in ("k_smem", "v_smem", "k_bars", "v_bars"))
    k_f16, v_f16, p_smem = (scratch.get(n) for n in ("k_f16", "v_f16", "p_smem"))
    for s in range(num_stages):
        pl.when(s < num_steps)(functools.partial(fetch, s, s))
    m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((rows,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((rows, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    def step_fn(step, carry, masked=True):
        acc, m_i, l_i = carry
        slot = lax.rem(step, num_stages)
        plgpu.barrier_wait(k_bars.at[slot])
        k_tile = _converted(k_smem.at[slot], k_f16)

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_tile.T)
            return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((rows, block_kv), jnp.float32)) * scale
        if masked:
            s = mask(step, s)
        p, m_new, l_i, acc = online_softmax_update(s, m_i, l_i, acc)
        plgpu.barrier_wait(v_bars.at[slot])
        acc = acc + pv_product(p, _converted(v_smem.at[slot], v_f16), p_smem, rows, head_dim)
        # Both products have completed: the slot is free for the step num_stages ahead.
        nxt = step + num_stages
        pl.when(nxt < num_steps)(functools.partial(fetch, nxt, slot))
        return acc, m_new, l_i

    carry = (acc, m_i, l_i)
    if not isinstance(unmasked_steps, int) or unmasked_steps:   # a static 0 traces no empty loop
        carry = lax.fori_loop(0, unmasked_steps, functools.partial(step_fn, masked=False), carry)
    return lax.fori_loop(unmasked_steps, num_steps, step_fn, carry)


def positions_before(end, start, block_kv: int, rows: int):
    """The mask of a block stream over positions start, start + 1, ...: hide those >= end."""
    def mask(step, s):
        pos = start + step * block_kv + plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 1,
                                                               layout=plgpu.Layout.WGMMA)
        return jnp.where(pos < end, s, -jnp.inf)
    return mask

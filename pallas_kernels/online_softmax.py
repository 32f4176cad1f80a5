"""The flash-attention pieces shared by the paged decode and ragged prefill kernels.

Scores are in base 2 (the caller folds sm_scale * log2(e) into one multiply); the running row max
`m`, row sum `l` and output accumulator `acc` are f32 registers of a 64-row wgmma tile.
"""
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


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


def kv_pipeline_scratch(num_stages: int, block_kv: int, head_dim: int, dtype, transforms, pages_per_block: int,
                        rows: int, p_in_smem: bool) -> tuple:
    """Scoped scratch of the K/V pipeline, in `attend`'s argument order: K and V stage buffers
    [num_stages, block_kv, head_dim], their TMA barriers (one arrival per page of a block), and
    the P tile in shared memory where wgmma needs it (interpret mode)."""
    buffers = plgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=transforms)
    barriers = plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages)
    p_tile = [plgpu.SMEM((rows, block_kv), dtype, transforms=transforms)] if p_in_smem else []
    return (buffers, buffers, barriers, barriers, *p_tile)

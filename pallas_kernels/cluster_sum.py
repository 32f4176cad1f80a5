"""Sum the f32 accumulators of a 2-block cluster into its first block (a K split inside one kernel).

Each block of the cluster multiplies half of K; the second block stores its accumulator into the
first block's shared memory (distributed shared memory, `st.shared::cluster`), both pass the
cluster barrier (`barrier.cluster.arrive` / `wait`: release / acquire at cluster scope), and the
first block adds it to its own and runs the epilogue. One handshake of two blocks on one GPC,
instead of f32 partials in HBM and a second kernel to sum them.

Mosaic GPU's Pallas store cannot target a peer block's shared memory in this jax (0.11.2:
"Unsupported memory space: #mosaic_gpu.smem_cluster"), so the store, the barrier and the matching
load are written with `inline_mgpu`. Interpret mode has neither `inline_mgpu` nor cluster refs:
there the second block hands its accumulator over through a global-memory buffer and a
`ClusterBarrier` instead (`spill_gmem`), which checks the same K halves and predicates on a CPU.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import gpu as gpu_dialect
from jax._src.lib.mlir.dialects import llvm
from jax.experimental import mosaic
from jax.experimental.pallas import mosaic_gpu as plgpu

AXIS = "kc"   # the cluster axis name of the kernels that use this


@plgpu.inline_mgpu()
def _cluster_barrier(_):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [],
                    "barrier.cluster.arrive.aligned; barrier.cluster.wait.aligned;", "", has_side_effects=True)


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
def _store_to_leader(_, acc, ref):
    utils = mosaic.gpu.utils
    leader = utils.get_cluster_ref(ref, gpu_dialect.Dimension.x, utils.c(0, ir.IndexType.get()), generic=False)
    acc.store_untiled(leader, optimized=False)


def _load(shape):
    mgpu = mosaic.gpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct(shape, jnp.float32, plgpu.Layout.WGMMA))
    def load(_, ref):
        return mgpu.FragmentedArray.load_untiled(ref, layout=mgpu.WGMMA_LAYOUT, is_signed=None, optimized=False)

    return load


def hand_over(acc, recv_smem, *, interpret=False, spill_gmem=None):
    """In the second block: acc (f32, WGMMA layout) -> the first block's recv_smem (same shape)."""
    if interpret:
        recv_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(recv_smem, spill_gmem)
        plgpu.wait_smem_to_gmem(0)
    else:
        _store_to_leader(acc, recv_smem)


def barrier(*, interpret=False, cluster_barrier=None):
    """Every thread of both blocks: what the second block handed over is visible to the first after it."""
    if interpret:
        plgpu.barrier_arrive(cluster_barrier)
        plgpu.barrier_wait(cluster_barrier)
    else:
        _cluster_barrier()


def take(recv_smem, *, interpret=False, spill_gmem=None, spill_barrier=None):
    """In the first block, after `barrier`: the second block's accumulator (f32, WGMMA layout)."""
    if interpret:
        plgpu.copy_gmem_to_smem(spill_gmem, recv_smem, spill_barrier)
        plgpu.barrier_wait(spill_barrier)
        return plgpu.load(recv_smem, layout=plgpu.Layout.WGMMA)
    return _load(recv_smem.shape)(recv_smem)

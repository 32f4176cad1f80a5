"""Asking the L2 cache to fetch the next kernel's weight while a latency-bound kernel runs.

At small decode batches the attention kernel reads little (a few hundred KB of K/V) and spends
several microseconds on latency while HBM sits idle; the projection after it (o_proj) then streams
its whole weight from HBM. A kernel given that weight (flattened to 1-D, a free reshape) issues bulk
L2 prefetches (`cp.async.bulk.prefetch.L2`: no shared memory, nothing to wait for) of its first
`max_bytes`, in chunks spread over the kernel's programs, so the GEMM after it finds that part of
its weight in L2.

The 1-D bulk form matters: a tensor (TMA box) prefetch moves at most 256 elements per row, and its
issue cost grew with the rows (on the H100 a 256 x 256 box per program lengthened the attention
kernel by 4-6.5 us; docs/perf_attention.md, session 9). Interpret mode skips the prefetch (jax's
GPU interpreter cannot run inline Mosaic GPU code); it changes no result anyway.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

CHUNK_BYTES = 128 << 10   # bytes per prefetch instruction (a multiple of 16, as the instruction needs)


@dataclasses.dataclass(frozen=True)
class PrefetchPlan:
    chunk: int        # elements per prefetch instruction
    num_chunks: int   # chunks prefetched, from the array's start


def _bits(dtype) -> int:
    return 4 if jnp.dtype(dtype) == jnp.int4 else jnp.dtype(dtype).itemsize * 8


def plan_prefetch(shape: tuple[int, ...], dtype, max_bytes: int) -> PrefetchPlan | None:
    """Whole chunks covering the first `max_bytes` (at most the whole array) of a row-major
    array, or None when not one chunk fits (an array that small is not worth prefetching)."""
    size = 1
    for d in shape:
        size *= d
    chunk = CHUNK_BYTES * 8 // _bits(dtype)
    num = min(size // chunk, max_bytes // CHUNK_BYTES)
    return PrefetchPlan(chunk, num) if num > 0 else None


def flat(w: jax.Array) -> jax.Array:
    """The 1-D view the kernel takes (a bitcast for XLA: no copy)."""
    return w.reshape(-1)


MODE = "lines"   # "lines": every thread prefetches 128-byte lines; "bulk": one bulk instruction
_THREADS = 128   # a warpgroup: the threads of the kernel's block


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def _line_prefetch(ctx, ref):
    """Each thread of the warpgroup asks the L2 for its share of the chunk's 128-byte lines
    (`prefetch.global.L2::evict_last`: no register written, nothing tracked)."""
    del ctx
    ty = ir.MemRefType(ref.type)
    nbytes = ty.shape[0] * mgpu_utils.bitwidth(ty.element_type) // 8
    i64 = ir.IntegerType.get_signless(64)
    offset = arith.muli(arith.extui(i64, mgpu_utils.thread_idx()), mgpu_utils.c(128, i64))
    lines = "".join(f"prefetch.global.L2::evict_last [a+{k * _THREADS * 128}];"
                    for k in range(nbytes // (_THREADS * 128)))
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [mgpu_utils.memref_ptr(ref), offset],
                    "{ .reg .u64 a; add.u64 a, $0, $1; " + lines + " }", "l,l", has_side_effects=True)


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def _bulk_prefetch(ctx, ref):
    """One thread of the block asks the L2 for the bytes of a contiguous 1-D GMEM slice."""
    del ctx
    ty = ir.MemRefType(ref.type)
    nbytes = ty.shape[0] * mgpu_utils.bitwidth(ty.element_type) // 8
    pred = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.BLOCK)
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [pred, mgpu_utils.memref_ptr(ref)],
                    f"@$0 cp.async.bulk.prefetch.L2.global [$1], {nbytes};", "b,l", has_side_effects=True)


def issue_prefetch(w_ref, plan: PrefetchPlan, program: jax.Array, num_programs: int, when=True):
    """Inside a kernel (not interpreted): this program's chunks p, p + P, ... of w_ref (1-D)."""
    for j in range(pl.cdiv(plan.num_chunks, num_programs)):
        i = program + j * num_programs

        @pl.when(when & (i < plan.num_chunks))
        def _():
            (_line_prefetch if MODE == "lines" else _bulk_prefetch)(w_ref.at[pl.ds(i * plan.chunk, plan.chunk)])

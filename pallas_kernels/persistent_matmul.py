"""Persistent decode matmul: y = x @ W for the few rows of a decode step, W a per-channel int8 / fp8
weight a few waves of 64-column tiles wide (Llama-3.1-8B's gate_up: 448 tiles on the H100's 132
SMs), streamed by one block per SM in one pipeline.

Why: one block per tile (pallas_kernels/decode_matmul.py) runs gate_up in ceil(448 / 132) = 4 waves
of 3.4 tiles' work, and each new wave's blocks wait one load latency before their first tile
arrives (46.8 us for fp8 at 8 rows, 83% of copy bandwidth: docs/performance.md, session 27).
Here each block owns `whole` consecutive tiles and streams all their K steps through one pipeline,
so the next tile's loads are in flight while a tile's epilogue runs; the tiles left over after
`whole` per block (the "tail": 52 for gate_up) split over K in 2-block clusters, the second block
handing its f32 product to the first through distributed shared memory (pallas_kernels/
cluster_sum.py). Every block then streams whole * steps + steps / 2 at most, against an average
of tiles * steps / blocks (gate_up in 512-row steps: 28 against 27.2).

Measured (session 27, H100, notebooks/gpu_persistent_matmul.py; docs/performance.md): it streams
gate_up at 86-87% of copy, up from 82-84% one block per tile, but XLA's convert-fused GEMM takes
it at 90% at the engine's 8 rows (fp8 43.1 against 44.2 us, int8 43.1 against 44.9); only at one
row, which the engine never runs on a GPU, is it the faster (fp8 45.0 against 48.1, int8 45.5
against 53.0). In the 8B bs=1 step it takes 44.5 us against XLA's 42.2 (the bench's multi-step
launch, and since session 28 the one-step executable too), and the bench's fp8 step was 0.1 ms
slower with it (3.36 against 3.26 ms). So it is opt-in (`pays`). The LM head streams as fast one block per tile (fp8 at 8 rows
181.8 against 182.4-197.3 us).

Kernel: the decode matmul's swap-AB wgmma (acc[64, m] += W tile converted to bf16 in registers,
times x.T); the pipeline's step s reads tile `tile_of(s)` at K step `k_step_of(s)`, with that
tile's 64 channel scales; at the last K step of a whole tile the step's body runs the epilogue
(channel scales, rounding, TMA store), and the next tile's sum starts from zero. Each step's
product comes from a wgmma accumulator of its own, added to an f32 pipeline carry: GPU interpret
mode (CI) cannot zero a wgmma accumulator in place (jax 0.11.2).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import cluster_sum
from pallas_kernels.decode_matmul import one_block_per_sm, tile_epilogue, weight_tile_bf16
from pallas_kernels.decode_matmul_rules import MAX_ROWS, QUANT_DTYPES, TILE_N, WIDE_MIN_TILES, weight_dtype
from pallas_kernels.decode_switches import enabled, wide_setting
from pallas_kernels.gemm_tiling import SMEM_BUDGET, interpret_params, num_sms, swizzled
from pallas_kernels.quant_format import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class PersistentConfig:
    # the fastest of 256 x (4, 6, 8) and 512 x (3, 4) for the 8B gate_up at 8 rows on the H100 (session 27)
    tile_k: int = 512              # K rows per pipeline step (a multiple of 64; K a multiple of 2 tile_k)
    max_concurrent_steps: int = 4  # TMA steps in flight (capped by shared memory)
    blocks: int = 0                # blocks (one per SM); 0: the device's SMs, rounded down to even

    def __post_init__(self):
        if self.tile_k <= 0 or self.tile_k % 64:
            raise ValueError(f"tile_k must be a positive multiple of 64, got {self.tile_k}")
        if self.max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps must be positive, got {self.max_concurrent_steps}")
        if self.blocks < 0 or self.blocks % 2:
            raise ValueError(f"blocks must be even (2-block clusters), got {self.blocks}")

    def num_blocks(self) -> int:
        return self.blocks or num_sms() // 2 * 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How `tiles` column tiles spread over `blocks` blocks: block b runs tiles [b * whole, (b + 1) *
    whole) over all of K, then cluster q < tail (blocks 2q, 2q + 1) splits tile whole * blocks + q
    over the halves of K."""
    tiles: int
    blocks: int

    @property
    def whole(self) -> int:
        return self.tiles // self.blocks

    @property
    def tail(self) -> int:
        return self.tiles - self.whole * self.blocks

    def runs(self) -> bool:
        """At least one whole tile per block (else one block per tile already fills the GPU), and
        at most one tail tile per cluster."""
        return self.whole >= 1 and self.tail <= self.blocks // 2


def fits(m: int, k: int, w, config: PersistentConfig | None = None) -> bool:
    """Whether `persistent_matmul` takes x[m, k] @ w (w a per-channel int8 / fp8 weight [k, n])."""
    config = config or PersistentConfig()
    n = w.shape[1]
    return (isinstance(w, QuantizedWeight) and weight_dtype(w) in QUANT_DTYPES   # per channel, unpadded
            and 0 < m <= MAX_ROWS and n % TILE_N == 0 and k % (2 * config.tile_k) == 0
            and Schedule(n // TILE_N, config.num_blocks()).runs())


def pays(m: int, k: int, x_dtype, w) -> bool:
    """Whether a model matmul should run this kernel on this (GPU) backend: opt-in for A/B
    measurements (`ATLASJAX_DECODE_MATMUL_WIDE=persistent`, on the GPUs where the decode matmul is
    `enabled`), bf16 activations, and a weight `fits` takes narrower than WIDE_MIN_TILES tiles (the
    LM head streams as fast one block per tile: fp8 at 8 rows on the H100, 181.8 against 182.4 us at
    best, session 27)."""
    return (wide_setting() == "persistent" and enabled() and jnp.dtype(x_dtype) == jnp.bfloat16
            and w.shape[1] // TILE_N < WIDE_MIN_TILES and fits(m, k, w))


def persistent_matmul_kernel(w_gmem, x_gmem, ws_gmem, out_gmem, *scratch, k, tile_k, depth, schedule,
                             stage_weight, mma_order, interpret):
    """Refs: w_gmem [N, K] int8 / fp8 codes; x_gmem [m, K] bf16; ws_gmem [N] f32 channel scales;
    out_gmem [m, N]; in interpret mode a spill output [N, m] f32 (cluster_sum.py); scratch: out_smem
    [m, TILE_N]; tail_ws_smem [TILE_N] f32 and its barrier; recv_smem [TILE_N, m] f32; staged_w_smem
    [TILE_N, tile_k] bf16 (stage_weight); in interpret mode the spill's barrier and a
    cluster barrier; last, unused padding (one block per SM)."""
    scratch = list(scratch)
    take = lambda present: scratch.pop(0) if present else None   # noqa: E731
    spill_gmem = take(interpret)
    out_smem, tail_ws_smem, tail_ws_barrier, recv_smem = (take(True) for _ in range(4))
    staged_w_smem = take(stage_weight)
    spill_barrier, cluster_barrier = take(interpret), take(interpret)

    m = x_gmem.shape[0]
    steps = k // tile_k
    half = steps // 2
    whole, tail = schedule.whole, schedule.tail
    whole_steps = whole * steps
    q, part = lax.axis_index("n"), lax.axis_index(cluster_sum.AXIS)
    first_tile = (2 * q + part) * whole
    has_tail = q < tail
    tail_tile = whole * schedule.blocks + q

    @pl.when(has_tail)
    def _():   # the tail tile's scales, in flight while the whole tiles stream
        plgpu.copy_gmem_to_smem(ws_gmem.at[pl.ds(tail_tile * TILE_N, TILE_N)], tail_ws_smem, tail_ws_barrier)

    def tile_of(s):
        return jnp.where(s < whole_steps, first_tile + s // steps, tail_tile)

    def k_step_of(s):
        return jnp.where(s < whole_steps, s % steps, part * half + s - whole_steps)

    w_bits = jnp.dtype(w_gmem.dtype).itemsize * 8
    specs = [plgpu.BlockSpec((TILE_N, tile_k), lambda s: (tile_of(s), k_step_of(s)),
                             transforms=swizzled(tile_k * w_bits, w_bits, "weight")),
             plgpu.BlockSpec((m, tile_k), lambda s: (0, k_step_of(s)),
                             transforms=swizzled(tile_k * 16, 16, "x")),
             plgpu.BlockSpec((TILE_N,), lambda s: (tile_of(s),))]
    num_steps = whole_steps + (jnp.where(has_tail, half, 0) if tail else 0)
    epilogue = functools.partial(tile_epilogue, ssq=None, r_smem=None, r_barrier=None, out_smem=out_smem, k=k,
                                 prologue=None, eps=0.0)

    def step(idx, w_smem, x_smem, ws_smem, total):
        s = idx[0]
        if stage_weight:
            a = staged_w_smem
            a[...] = weight_tile_bf16(w_smem, mma_order, interpret)
            plgpu.commit_smem()
        else:
            a = weight_tile_bf16(w_smem, mma_order, interpret)

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a, x_smem.T)
            return acc_ref[...]
        total = total + pl.run_scoped(mma, plgpu.ACC((TILE_N, m), jnp.float32))
        tile_done = (s < whole_steps) & (s % steps == steps - 1)

        @pl.when(tile_done)
        def _():   # a whole tile's last K step: its product out
            epilogue(total, ws_smem=ws_smem, ws_barrier=None,
                     out_gmem=out_gmem.at[:, pl.ds(tile_of(s) * TILE_N, TILE_N)])
        restart = lax.broadcast_in_dim(tile_done, total.shape, ())   # the next tile starts from zero
        return lax.select(restart, jnp.zeros_like(total), total)

    acc = plgpu.emit_pipeline(step, grid=(num_steps,), in_specs=specs, max_concurrent_steps=depth,
                              init_carry=jnp.zeros((TILE_N, m), jnp.float32))(w_gmem, x_gmem, ws_gmem)
    if not tail:
        return
    cols = pl.ds(tail_tile * TILE_N, TILE_N)

    @pl.when(has_tail)
    def _():   # both blocks of the cluster: the tail tile's halves of K summed in the first
        exchange = dict(interpret=interpret, spill_gmem=spill_gmem.at[cols] if interpret else None)
        pl.when(part == 1)(lambda: cluster_sum.hand_over(acc, recv_smem, **exchange))
        cluster_sum.barrier(interpret=interpret, cluster_barrier=cluster_barrier)
        pl.when(part == 0)(lambda: epilogue(
            acc + cluster_sum.take(recv_smem, spill_barrier=spill_barrier, **exchange),
            ws_smem=tail_ws_smem, ws_barrier=tail_ws_barrier, out_gmem=out_gmem.at[:, cols]))


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def persistent_matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype=None, config: PersistentConfig | None = None,
                      interpret=False) -> jax.Array:
    """y = x @ w with f32 accumulation, times w's channel scales, rounded to out_dtype (default
    x.dtype), as `decode_matmul_reference` computes. x [M, K] (M <= MAX_ROWS); w a per-channel int8 /
    fp8 `QuantizedWeight` of logical shape (K, N) stored without padding, N a multiple of 64 whose
    tiles `Schedule(...).runs()` on the config's blocks, K a multiple of 2 tile_k."""
    config = config or PersistentConfig()
    m, k = x.shape
    n = w.shape[1]
    if not fits(m, k, w, config):
        raise ValueError(
            f"persistent_matmul takes a per-channel int8 / fp8 QuantizedWeight without padding, 1 <= M <= "
            f"{MAX_ROWS}, N % {TILE_N} == 0 with at least one tile of {TILE_N} columns per block and at most "
            f"one more per two blocks ({config.num_blocks()} blocks), and K % {2 * config.tile_k} == 0; got "
            f"M={m}, K={k}, N={n}, {getattr(w, 'format', None) or w.dtype}")
    schedule = Schedule(n // TILE_N, config.num_blocks())
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    stage_weight = bool(interpret)   # interpret mode's wgmma reads shared memory only
    m_pad = -(-m // 8) * 8    # wgmma N: a multiple of 8
    per_step = config.tile_k * TILE_N + m_pad * config.tile_k * 2 + TILE_N * 4
    fixed = m_pad * TILE_N * out_dtype.itemsize + TILE_N * 4 + TILE_N * m_pad * 4
    fixed += stage_weight * TILE_N * config.tile_k * 2
    depth = max(1, min(config.max_concurrent_steps, (SMEM_BUDGET - fixed) // per_step))
    scratch = [plgpu.SMEM((m_pad, TILE_N), out_dtype), plgpu.SMEM((TILE_N,), jnp.float32),
               plgpu.Barrier(num_arrivals=1), plgpu.SMEM((TILE_N, m_pad), jnp.float32)]
    if stage_weight:
        scratch.append(plgpu.SMEM((TILE_N, config.tile_k), jnp.bfloat16,
                                  transforms=swizzled(config.tile_k * 16, 16, "a")))
    out_type = jax.ShapeDtypeStruct((m_pad, n), out_dtype)
    if interpret:   # cluster_sum hands the tail's product over through HBM there
        out_type = (out_type, jax.ShapeDtypeStruct((n, m_pad), jnp.float32))
        scratch += [plgpu.Barrier(num_arrivals=1), plgpu.ClusterBarrier(collective_axes=(cluster_sum.AXIS,))]
    scratch += one_block_per_sm(fixed + depth * per_step)
    call = plgpu.kernel(
        functools.partial(persistent_matmul_kernel, k=k, tile_k=config.tile_k, depth=depth,
                          schedule=schedule, stage_weight=stage_weight, mma_order=w.mma_order,
                          interpret=bool(interpret)),
        out_type=out_type,
        scratch_types=scratch,
        grid=(schedule.blocks // 2,), grid_names=("n",),
        cluster=(2,), cluster_names=(cluster_sum.AXIS,),
        interpret=interpret_params(interpret),
        kernel_name=f"persistent_matmul_{w.format}",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    x_pad = jnp.pad(x.astype(jnp.bfloat16), ((0, m_pad - m), (0, 0)))
    out = call(w.qweight, x_pad, w.scales.reshape(n).astype(jnp.float32))
    return (out[0] if interpret else out)[:m]

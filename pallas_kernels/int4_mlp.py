"""A decode step's SwiGLU MLP on int4 weights as one persistent Mosaic GPU kernel (opt-in).

partials[j] = (silu(x @ Wg) * (x @ Wu))[:, K_j] @ Wd[K_j, :], summed over the down projection's K
splits j by the caller (with the residual). Weights: the engine's int4 (groups of 128, integer zero
points, mma order); gate_up fused as [gate | up] along N (models/fused.py).

Why one kernel (docs/performance.md, session 36): with gate_up and down as two kernels, the SMs
that finish their gate_up tiles early sit idle until the last ones finish, and down's weight stream
only ramps up after that. Here block b
1. computes gate_up's 64-column tile pair b (gate's columns and up's same columns: two weight tiles
   a step, the int4 kernel's per-group pipeline), then h = silu(gate) * up for those 64 columns,
   stored to `h` in global memory, and signals a global semaphore;
2. runs down's unit b (64 output columns x 1/splits of K, as the int4 kernel splits down). Its
   pipeline issues its first weight tiles at once; its first step waits until every block has
   signalled, then issues the loads of the unit's slice of h, and each step waits for its own.
So down's first weight tiles load while the last gate_up tiles finish, and no silu x up kernel
runs between the two. The grid is max(pairs, units) blocks (256 for Llama-3.1-8B: 224 pairs, 64 x 4
units), and every block must be resident at once, since the semaphore waits for all: two per SM
(`fits` checks the shared memory).

Measured on the H100 (session 36, docs/performance.md): alone, 42.8 us against 44.5 for the two int4
kernels and XLA's silu x up at the 8B's shapes; in the 8B int4 step, 2.35 ms against 2.36-2.37,
within run-to-run noise. So the model runs it only with `ATLASJAX_INT4_MLP=on`
(pallas_kernels/decode_switches.py).

GPU interpret mode has no semaphores, so there (`phases="split"`) the two phases run as two kernel
calls of the same code, which tests everything but the barrier.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm_tiling import interpret_params, num_sms, swizzled
from pallas_kernels.int4_mma_order import mma_tile_to_bf16
from pallas_kernels.quant_format import QuantizedWeight, dequantize

TILE_N = 64          # output columns per block tile (the M of one wgmma, swap AB)
GROUP = 128          # K elements per group: the engine's int4
STEP_K = 2 * GROUP   # K per pipeline step: two groups, one 128-byte row of int4 in mma order
GATE_UP_DEPTH = 3    # pipeline steps in flight: gate_up (two weight tiles a step)
DOWN_DEPTH = 4       # and down
SPLITS = 4           # down units per 64 output columns, as the int4 kernel splits down
MAX_ROWS = 16
BLOCKS_PER_SM = 2
SMEM_PER_BLOCK = 100 * 1024   # what two blocks per SM may use, with room for what the estimate misses


def fits(x_rows: int, gate_up: QuantizedWeight, down: QuantizedWeight, splits: int = SPLITS) -> bool:
    """Whether the kernel takes these weights at `x_rows` activation rows on this GPU."""
    def engine_int4(qw):
        return (qw.format == "int4" and qw.group_size == GROUP and qw.zero_point and qw.mma_order
                and not qw.two_level and qw.padded_shape == qw.shape)
    if not (engine_int4(gate_up) and engine_int4(down) and 0 < x_rows <= MAX_ROWS):
        return False
    hidden, gu = gate_up.shape
    inter = gu // 2
    return (gu % (2 * TILE_N) == 0 and down.shape[0] == inter and hidden % STEP_K == 0
            and (inter // STEP_K) % splits == 0 and down.shape[1] % TILE_N == 0
            and grid_size(inter, down.shape[1], splits) <= BLOCKS_PER_SM * num_sms()
            and smem_bytes(x_rows, inter, splits) <= SMEM_PER_BLOCK)


def grid_size(inter: int, out_n: int, splits: int) -> int:
    """Blocks: one per gate_up tile pair and one per down unit."""
    return max(inter // TILE_N, out_n // TILE_N * splits)


def smem_bytes(x_rows: int, inter: int, splits: int) -> int:
    """Shared memory of one block: the larger phase's pipeline (and slice of h), and the output tiles."""
    m_tile = -(-x_rows // 8) * 8
    rows = 2 * TILE_N * 2   # a step's two group rows (f16) of scales or of zero points
    gate_up = GATE_UP_DEPTH * (2 * (TILE_N * STEP_K // 2 + 2 * rows) + m_tile * STEP_K * 2)
    down = DOWN_DEPTH * (TILE_N * STEP_K // 2 + 2 * rows) + inter // splits * m_tile * 2
    return max(gate_up, down) + m_tile * TILE_N * (2 + 4)


def _rows(ref, i):   # row i of a group-rows tile as f32 [TILE_N] in the wgmma row layout
    return plgpu.load(ref.at[i], layout=plgpu.Layout.WGMMA.reduce(1)).astype(jnp.float32)


def _issue_groups(w_smem, z_smem, x_of_group, interpret, scratch):
    """The step's two groups of one weight tile: q - z in bf16 times x, as two f32 partials."""
    def issue(*accs):
        w = w_smem[...]
        for i in range(2):
            a = mma_tile_to_bf16(w, _rows(z_smem, i), parts=2, part=i, interpret=interpret)
            if scratch is not None:   # interpret mode: wgmma reads its A operand from shared memory
                scratch[...] = a
                plgpu.commit_smem()
                a = scratch
            plgpu.wgmma(accs[i], a, x_of_group(i).transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return [r[...] for r in accs]
    return issue


def _scaled(parts, s_smem, acc):
    for i, part in enumerate(parts):
        acc = acc + part * lax.broadcast_in_dim(_rows(s_smem, i), acc.shape, [0])
    return acc


def _specs(m_tile, first=0):
    """Step k's weight tile, group rows and activation tile, from K step `first` on."""
    w = plgpu.BlockSpec((TILE_N, STEP_K), lambda k: (0, first + k), transforms=swizzled(STEP_K * 4, 4, "weight"))
    rows = plgpu.BlockSpec((2, TILE_N), lambda k: (first + k, 0))
    x = plgpu.BlockSpec((m_tile, STEP_K), lambda k: (0, first + k), transforms=swizzled(GROUP * 16, 16, "x"))
    return w, rows, x


def _gate_up_phase(x_gmem, w_gmem, s_gmem, z_gmem, h_gmem, h_smem, *, block, inter, m_tile, interpret, scratch):
    """h[:, block tile] = silu(x @ Wg[:, tile]) * (x @ Wu[:, tile]), rounded as the unfused model rounds."""
    w_spec, row_spec, x_spec = _specs(m_tile)
    gate, up = pl.ds(block * TILE_N, TILE_N), pl.ds(inter + block * TILE_N, TILE_N)
    zeros = plgpu.layout_cast(jnp.zeros((TILE_N, m_tile), jnp.float32), plgpu.Layout.WGMMA)
    acc_t = plgpu.ACC((TILE_N, m_tile), jnp.float32)

    def step(_, wg, wu, sg, zg, su, zu, xs, carry):
        acc_g, acc_u = carry
        def x_of(i):
            return xs.at[:, pl.ds(i * GROUP, GROUP)]
        parts_g = pl.run_scoped(_issue_groups(wg, zg, x_of, interpret, scratch), acc_t, acc_t)
        parts_u = pl.run_scoped(_issue_groups(wu, zu, x_of, interpret, scratch), acc_t, acc_t)
        return _scaled(parts_g, sg, acc_g), _scaled(parts_u, su, acc_u)

    acc_g, acc_u = plgpu.emit_pipeline(
        step, grid=(x_gmem.shape[1] // STEP_K,), in_specs=[w_spec, w_spec] + [row_spec] * 4 + [x_spec],
        max_concurrent_steps=GATE_UP_DEPTH, init_carry=(zeros, zeros),
    )(w_gmem.at[gate], w_gmem.at[up], s_gmem.at[:, gate], z_gmem.at[:, gate], s_gmem.at[:, up], z_gmem.at[:, up],
      x_gmem)
    # The unfused model rounds gate_up to bf16, then computes silu(gate) * up (models/deferred.py).
    g = acc_g.astype(jnp.bfloat16).astype(jnp.float32)
    u = acc_u.astype(jnp.bfloat16).astype(jnp.float32)
    h = (g / (1.0 + jnp.exp(-g)) * u).astype(jnp.bfloat16)
    h_smem.T[...] = plgpu.layout_cast(h, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_smem, h_gmem.at[:, gate])
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)   # h is in memory before the block signals


def _down_phase(h_gmem, w_gmem, s_gmem, z_gmem, out_gmem, out_smem, *, unit, m_tile, splits, wait_for,
                interpret, scratch):
    """Down's unit `unit`: out[j, :, tile] = h[:, K_j] @ Wd[K_j, tile] for (tile, j) = divmod(unit, splits).
    wait_for: a () -> None that blocks until every block's h is written, or None. The first step calls
    it, after the pipeline has issued its first weight tiles, then issues the loads of the unit's slice
    of h; each step waits for its own."""
    steps = h_gmem.shape[1] // STEP_K // splits
    tile, split = unit // splits, lax.rem(unit, splits)
    cols = pl.ds(tile * TILE_N, TILE_N)
    w_spec, row_spec, _ = _specs(m_tile, split * steps)   # the activations come from the h slice
    acc_t = plgpu.ACC((TILE_N, m_tile), jnp.float32)

    def with_h(hs_smem, h_bars):   # hs_smem: the unit's slice of h, [steps, m_tile, STEP_K]
        def step(idx, w, s_rows, z_rows, acc):
            k = idx[0]

            @pl.when(k == 0)
            def _():
                if wait_for is not None:
                    wait_for()
                for s in range(steps):   # STEP_K columns per copy: a TMA box is at most 256 wide
                    plgpu.copy_gmem_to_smem(h_gmem.at[:, pl.ds((split * steps + s) * STEP_K, STEP_K)],
                                            hs_smem.at[s], h_bars.at[s])

            plgpu.barrier_wait(h_bars.at[k])   # this step's slice of h (all were issued in step 0)

            def x_of(i):
                return hs_smem.at[k, :, pl.ds(i * GROUP, GROUP)]
            parts = pl.run_scoped(_issue_groups(w, z_rows, x_of, interpret, scratch), acc_t, acc_t)
            return _scaled(parts, s_rows, acc)

        acc = plgpu.emit_pipeline(
            step, grid=(steps,), in_specs=[w_spec, row_spec, row_spec], max_concurrent_steps=DOWN_DEPTH,
            init_carry=plgpu.layout_cast(jnp.zeros((TILE_N, m_tile), jnp.float32), plgpu.Layout.WGMMA),
        )(w_gmem.at[cols], s_gmem.at[:, cols], z_gmem.at[:, cols])
        out_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, :, cols])
        plgpu.wait_smem_to_gmem(0)

    # scoped here, so that it reuses the gate_up pipeline's shared memory (two blocks fit per SM)
    h_slice = plgpu.SMEM((steps, m_tile, STEP_K), jnp.bfloat16, transforms=swizzled(GROUP * 16, 16, "x"))
    pl.run_scoped(with_h, h_slice, plgpu.Barrier(num_arrivals=1, num_barriers=steps))


@functools.partial(jax.jit, static_argnames=("interpret", "phases", "splits"))
def int4_mlp_partials(x: jax.Array, gate_up: QuantizedWeight, down: QuantizedWeight, *, interpret=False,
                      phases: str = "fused", splits: int = SPLITS) -> jax.Array:
    """x [M, hidden] (M <= 16) -> f32 partials [splits, M, out] of silu(x Wg) * (x Wu) @ Wd (`fits` must hold).

    phases: "fused" (one kernel, a grid barrier between gate_up and down; native only), "split"
    (two kernel calls of the same phases; what interpret mode runs), or "gate_up" (the first call
    alone, returning h [M, intermediate] bf16: for measurements)."""
    m, hidden = x.shape
    inter = gate_up.shape[1] // 2
    out_n = down.shape[1]
    m_tile = -(-m // 8) * 8
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, m_tile - m), (0, 0)))
    pairs, units = inter // TILE_N, out_n // TILE_N * splits
    blocks = grid_size(inter, out_n, splits)
    h_type = jax.ShapeDtypeStruct((m_tile, inter), jnp.bfloat16)
    out_type = jax.ShapeDtypeStruct((splits, m_tile, out_n), jnp.float32)
    scratch_a = ([plgpu.SMEM((TILE_N, GROUP), jnp.bfloat16, transforms=swizzled(GROUP * 16, 16, "a"))]
                 if interpret else [])
    down_scratch = [plgpu.SMEM((m_tile, TILE_N), jnp.float32)]
    params = dict(grid_names=("block",), interpret=interpret_params(interpret),
                  compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                                       approx_math=True))
    gu = (gate_up.qweight, gate_up.scales, gate_up.zeros)
    dn = (down.qweight, down.scales, down.zeros)

    def gate_up_args(block, h_smem, scratch):
        return dict(block=block, inter=inter, m_tile=m_tile, interpret=bool(interpret), h_smem=h_smem,
                    scratch=scratch[0] if scratch else None)

    def down_args(block, scratch, wait_for):
        return dict(unit=block, m_tile=m_tile, splits=splits, wait_for=wait_for,
                    interpret=bool(interpret), scratch=scratch[0] if scratch else None)

    if phases in ("split", "gate_up"):
        def gate_up_kernel(x_ref, w, s, z, h_ref, h_smem, *scratch):
            _gate_up_phase(x_ref, w, s, z, h_ref, **gate_up_args(lax.axis_index("block"), h_smem, scratch))

        def down_kernel(h_ref, w, s, z, out_ref, out_smem, *scratch):
            _down_phase(h_ref, w, s, z, out_ref, out_smem, **down_args(lax.axis_index("block"), scratch, None))
        h = plgpu.kernel(gate_up_kernel, out_type=h_type, kernel_name="int4_mlp_gate_up", grid=(pairs,),
                         scratch_types=[plgpu.SMEM((m_tile, TILE_N), jnp.bfloat16)] + scratch_a, **params)(xp, *gu)
        if phases == "gate_up":
            return h[:m]
        out = plgpu.kernel(down_kernel, out_type=out_type, kernel_name="int4_mlp_down", grid=(units,),
                           scratch_types=down_scratch + scratch_a, **params)(h, *dn)
    elif phases == "fused":
        def mlp_kernel(x_ref, wg, sg, zg, wd, sd, zd, h_ref, out_ref, h_smem, out_smem, *scratch):
            block = lax.axis_index("block")

            @pl.when(block < pairs)
            def _():
                _gate_up_phase(x_ref, wg, sg, zg, h_ref, **gate_up_args(block, h_smem, scratch))
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
            pl.semaphore_signal(sem)

            @pl.when(block < units)
            def _():
                _down_phase(h_ref, wd, sd, zd, out_ref, out_smem,
                            **down_args(block, scratch, lambda: pl.semaphore_wait(sem, blocks, decrement=False)))
        _, out = plgpu.kernel(mlp_kernel, out_type=(h_type, out_type), kernel_name="int4_mlp", grid=(blocks,),
                              scratch_types=[plgpu.SMEM((m_tile, TILE_N), jnp.bfloat16)] + down_scratch + scratch_a,
                              **params)(xp, *gu, *dn)
    else:
        raise ValueError(f"phases must be 'fused', 'split' or 'gate_up', got {phases!r}")
    return out[:, :m]


def int4_mlp_reference(x: jax.Array, gate_up: QuantizedWeight, down: QuantizedWeight) -> jax.Array:
    """What the unfused model computes, in jnp: [M, out] f32 (the kernel's partials summed)."""
    gu = jnp.dot(x.astype(jnp.float32), dequantize(gate_up), precision=lax.Precision.HIGHEST).astype(jnp.bfloat16)
    g, u = jnp.split(gu, 2, axis=-1)
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16)
    return jnp.dot(h.astype(jnp.float32), dequantize(down), precision=lax.Precision.HIGHEST)

"""y = x @ W for quantized W at more than MIN_ROWS (32) rows: a warp-specialized Mosaic GPU kernel.

Takes int4 in mma order and 8-bit codes (int8, fp8), per channel or in groups with integer zero
points or float offsets, in one or two levels (`fits`): the engine's int4, AWQ, GPTQ, GGUF Q4_0 /
Q4_1 / Q4_K / Q8_0, FP8 per channel or with block scales. The fused kernel of quantized_matmul.py
runs one warpgroup per block that converts a weight tile, waits for its wgmma, and holds an SM
alone (its x tiles fill the shared memory): at 256-768 rows it ran 1.4-1.8x the bf16 dot, and at
64-128 rows 1.1-1.6x this kernel (docs/perf_quant.md, sessions 37 and 39). Here a block has three
warpgroups, as in jax's `hopper_mixed_type_matmul_mgpu.py`:
- one issues the TMA loads of each 128-wide K step (128 weight rows, their group rows, and the
  m_tile x 128 activations) into a ring of `max_concurrent_steps` slots;
- two compute warpgroups each take 64 of the weight rows and convert them to bf16 in registers
  (int4 by `mma_tile_to_bf16`, a group's integer zero point subtracted in the conversion; 8-bit
  codes exactly by `codes_as_bf16`). Grouped weights are then multiplied by each group's scale
  (and offset added) in bf16, rounded once, as dequantize-then-dot rounds them; a per-channel
  scale multiplies the f32 result at the end. Each warpgroup accumulates W_tile @ x_tile^T in one
  f32 accumulator [64, m_tile] across all of K.
So one warpgroup converts while the other's wgmma runs, and the loads never wait for either.

Grid: (M tiles, N / 128, K splits), M first, so one weight tile's M tiles run next to each other
and all but the first read it from L2. Up to 128 rows one M tile holds every row; past that M
tiles are 128 or 256 rows. K is split in 1, 2 or 4 parts (`plan_for`): a narrow weight (down's
N = 4096: 32 blocks of 112 steps per M tile) would otherwise leave SMs idle. Split blocks store
f32 partials, which XLA sums (into the consumer where it can). GPU interpret mode cannot feed
wgmma from registers: there the converted tile is staged in shared memory.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm_tiling import elem_bits, interpret_params, num_sms, swizzled
from pallas_kernels.int4_mma_order import mma_tile_to_bf16
from pallas_kernels.quant_format import QuantizedWeight, codes_as_bf16, is_per_channel

WG_ROWS = 64              # weight rows per compute warpgroup (the M of one wgmma)
BLOCK_N = 2 * WG_ROWS     # weight rows (output columns) per block
STEP_K = 128              # K per pipeline step (one int4 group)
SMEM_BUDGET = 220 * 1024  # the pipeline ring and the output tiles (the H100 allows 227 KB per block)
MEMORY_REGISTERS = 40     # per thread of the TMA warpgroup (the compute warpgroups get the rest)
MAX_8BIT_ROWS = 1024      # 8-bit codes past this many rows: the weight dequantized for XLA's GEMM (`pays`)
WIDE_8BIT_N = 16384       # 8-bit weights at least this wide (after padding) ...
WIDE_8BIT_MAX_ROWS = 1023 # ... take the dequantized copy from 1,024 rows (`max_8bit_rows`), as do
DEEP_INT8_K = 12288       # int8 weights (per channel or in groups) at least this deep (after padding)
MIN_ROWS = 32             # up to this many rows the fused kernel (or the decode matmul) runs instead (`pays`)
# The H100 wave model of `plan_for`, checked on 109 measured (shape, rows, split) cases (sessions 38-39)
STEP_US = 0.8             # a 128-row block's K step
BLOCK_US = 4.0            # a block's fixed cost: ring fill, epilogue, the wave's ramp and tail
PARTIAL_BYTES_PER_US = 5e6     # f32 split partials written, then read by XLA's sum (mostly in L2)


def _groups_per_step(qw: QuantizedWeight) -> int:
    return max(1, STEP_K // qw.group_size)


def fits(qw: QuantizedWeight, m_tile: int = 128, out_dtype=jnp.bfloat16, k_splits: int = 1) -> bool:
    """Whether the kernel takes this weight at `m_tile` rows per tile: int4 in mma order or 8-bit
    codes in natural order (quantized_matmul permutes x for int8 in mma order first), per channel
    or in groups that tile a 128-wide step (32, 64, 128, 256, ...), with integer zero points, float
    offsets, two-level rows (super-groups of whole steps) or none; K a multiple of 128, N of 128
    (after padding); each of `k_splits` parts of K whole steps, groups and super-groups; and at
    least two pipeline steps in shared memory beside the output tiles (f32 when split)."""
    k_pad, n_pad = qw.padded_shape
    codes = (qw.format == "int4" and qw.mma_order) or (qw.format in ("int8", "fp8") and not qw.mma_order)
    groups = is_per_channel(qw) or (qw.format != "fp8" or qw.zeros is None) and (
        (STEP_K % qw.group_size == 0 or qw.group_size % STEP_K == 0)
        and (not qw.two_level or qw.super_group % STEP_K == 0)
        and (qw.format == "int4" or qw.zeros is None))
    steps = k_pad // STEP_K
    whole = _steps_per_unit(qw)
    splits = k_splits >= 1 and steps % k_splits == 0 and (steps // k_splits) % whole == 0
    return (codes and groups and splits and k_pad % STEP_K == 0 and n_pad % BLOCK_N == 0 and m_tile % 8 == 0
            and 8 <= m_tile <= 256 and _depth(m_tile, qw, _store_dtype(out_dtype, k_splits).itemsize) >= 2)


def _store_dtype(out_dtype, k_splits: int) -> jnp.dtype:
    """What a block stores: y itself, or an f32 partial when K is split."""
    return jnp.dtype(jnp.float32 if k_splits > 1 else out_dtype)


def _steps_per_unit(qw: QuantizedWeight) -> int:
    """Steps a K split part must be a multiple of: a group over several steps, a super-group."""
    group = 1 if is_per_channel(qw) else max(1, qw.group_size // STEP_K)
    return math.lcm(group, qw.super_group // STEP_K if qw.two_level else 1)


def pays(qw: QuantizedWeight, m: int) -> bool:
    """Whether quantized_matmul (prefill="auto") runs this kernel for a weight it takes, at m rows
    (H100, the 8B's projections, docs/perf_quant.md):
    - not up to MIN_ROWS: at 32 rows the fused kernel ran int4 gate_up, down and o_proj 3-17%
      faster (31.1 / 16.7 / 7.8 us against 34.9 / 19.5 / 8.2), and a decode step's per-channel
      qkv, o_proj and down take the decode matmul there (session 39);
    - at 64-128 rows, on every 8B projection and format measured (session 39): int4 g128, Q4_K,
      fp8 and int8 per channel 0.61-0.99x the time of what ran before (gate_up at 128 rows: int4
      78.1 -> 52.2 us, Q4_K 96.6 -> 59.8; down: int8 58.9 -> 35.9); fp8 gate_up tied with XLA's
      GEMM;
    - int4, any groups: at every count measured past that (256-2,048 rows). Groups of 128 ran
      0.6-1.2x the bf16 dot where the fused kernel or dequantize + dot ran 0.8-1.8x; GGUF Q4_K and
      Q4_1 (groups of 32) on gate_up 1.0-1.2x where they ran 1.4-2.1x (session 37);
    - 8-bit codes up to 1,024 rows: per-channel int8 / fp8 0-24% faster than XLA's convert-fused
      GEMM there, Q8_0 and block FP8 faster than the fused kernel or dequantize + dot at 256-512
      rows; at 2,048 rows those were as fast or up to 9% faster (session 37)."""
    return m > MIN_ROWS and (qw.format == "int4" or m <= max_8bit_rows(qw))


def max_8bit_rows(qw: QuantizedWeight) -> int:
    """The most rows at which an 8-bit weight (per channel or in groups) takes this kernel; past them the
    weight is dequantized for XLA's GEMM (`quantized_matmul.dequantized_dot`). H200, 1,024 rows
    (docs/perf_quant.md, session 86), us, this kernel against the dequantized copy: weights 16,384 or
    more wide ran 4-20% faster as the copy in every 8-bit format (gate_up 4096x28672 fp8 410 / 386, int8
    444 / 387, Q8_0 468 / 397; 4096x24576, 3072x16384, 2048x16384 and 8192x57344 alike); narrower ones
    (qkv, o_proj and the 1B / 3B downs, K <= 8,192) ran up to 1.48x faster on this kernel. The deep downs
    (K 12,288 / 14,336 / 28,672) ran faster on this kernel in fp8 (181 / 194 us on the 8B's) but 2-5% faster
    as the copy in int8 (199 / 194) and 6-9% in Q8_0's groups (212 / 199), so int8 codes that deep leave it
    too (session 87). Below 1,024 rows they stay (H100, session 88): at 640 rows this kernel ran the 8B
    gate_up 7-13% faster than the copy (fp8 274 / 313 us), at 768-896 within 5% either way (fp8 ahead), and
    the down as fast or faster at 768-896 rows (int8 169 / 174 with its K split; at 640 rows unsplit 195 / 154,
    and the 4-way split `plan_for` picks there was not measured); at 1,024 rows the copy
    won gate_up there too (fp8 429 / 417, int8 451 / 417, Q8_0 475 / 430), while the H100's int8 down
    stayed 1.5-5% faster on this kernel (197 / 207), a cost the gate_up's gain outweighs. A prefill's rows
    are a power of two or the token budget, so below 1,024 only a budget set between 512 and 1,024 meets
    the difference."""
    k_pad, n_pad = qw.padded_shape
    leaves = n_pad >= WIDE_8BIT_N or (qw.format == "int8" and k_pad >= DEEP_INT8_K)
    return WIDE_8BIT_MAX_ROWS if leaves else MAX_8BIT_ROWS


def plan_for(m: int, qw: QuantizedWeight, out_dtype=jnp.bfloat16) -> tuple[int, int]:
    """(rows per M tile, K splits) for m rows, from a wave model of the H100 (sessions 37-39,
    docs/perf_quant.md): one block per SM; a wave of blocks costs BLOCK_US plus a K step's time per
    step (STEP_US at 128 rows, 1.7x at 256, half of it plus a share per row below 128); split
    partials are written and read as f32 at ~PARTIAL_BYTES_PER_US. Up to 128 rows one M tile holds
    them all; past that 128-row tiles and fewer splits win ties, and a split must save a tenth.
    It picks the fastest split (within 1%) in all 109 measured cases (int4, Q4_K, fp8, int8; 8B,
    1B, Qwen3-8B and k/v shapes; 32-512 rows) and the faster tile where session 37's differed by
    over 1%. On the 8B it splits down and o_proj at 33-256 rows: in four up to 128 rows (one M
    tile of 32 blocks), in two past that (64 blocks left half the SMs idle; 1.6-1.9x the bf16 dot
    -> 0.96-1.24x); a GGUF layout's separate k and v (N = 1024) in four (~29 -> ~11 us in the step
    at 256 rows)."""
    n_blocks = qw.padded_shape[1] // BLOCK_N
    steps = qw.padded_shape[0] // STEP_K

    def cost(tile, splits):   # us
        m_pad = -(-m // tile) * tile
        waves = -(-(m_pad // tile) * n_blocks * splits // num_sms())
        partials = splits * m_pad * qw.padded_shape[1] * 8 if splits > 1 else 0
        step_us = STEP_US * (1.7 if tile > 128 else 0.5 + tile / 256)
        return waves * ((steps // splits) * step_us + BLOCK_US) + partials / PARTIAL_BYTES_PER_US
    tiles = [one_tile(m)] if m <= 128 else [128] + ([256] if fits(qw, 256, out_dtype) else [])
    tile = min(tiles, key=lambda t: cost(t, 1))
    split_tile = tiles[0]   # a split runs the smaller tile
    split = min((s for s in (2, 4) if fits(qw, split_tile, out_dtype, s)), key=lambda s: cost(split_tile, s), default=None)
    if split is not None and cost(split_tile, split) < 0.9 * cost(tile, 1):
        return split_tile, split
    return tile, 1


def one_tile(m: int) -> int:
    """Rows of one M tile that holds all m rows (a multiple of 8, the wgmma N step)."""
    return -(-m // 8) * 8


def _depth(m_tile: int, qw: QuantizedWeight, out_bytes: int, want: int = 4) -> int:
    """Pipeline steps in flight: as many as asked that fit (under 2: the tile does not fit)."""
    rows = 4 * 1024   # a step's group rows: at most 4 groups of scales and of offsets, f32, and two super rows
    per_step = m_tile * STEP_K * 2 + BLOCK_N * STEP_K * elem_bits(qw.qweight.dtype) // 8 + rows
    fixed = 2 * m_tile * WG_ROWS * out_bytes
    return min(want, (SMEM_BUDGET - fixed) // per_step)


@functools.partial(jax.jit, static_argnames=("m_tile", "k_splits", "max_concurrent_steps", "out_dtype", "interpret"))
def rows_matmul(x: jax.Array, qw: QuantizedWeight, *, m_tile: int = 128, k_splits: int = 1,
                max_concurrent_steps: int = 4, out_dtype=jnp.bfloat16, interpret=False) -> jax.Array:
    """x [M, K] -> y [M, N] in out_dtype (`fits(qw, m_tile, out_dtype, k_splits)` must hold), f32
    accumulation; with K split, each part's f32 partial summed after the kernel."""
    m, k = x.shape
    k_pad, n_pad = qw.padded_shape
    out_dtype = jnp.dtype(out_dtype)
    if k != qw.shape[0] or not fits(qw, m_tile, out_dtype, k_splits):
        raise ValueError(f"rows_matmul does not take x {x.shape} with this weight ({qw.shape}, "
                         f"{qw.format}, groups of {qw.group_size}) at m_tile {m_tile}, {k_splits} K "
                         f"split(s) ({out_dtype} out)")
    m_pad = -(-m // m_tile) * m_tile
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, m_pad - m), (0, k_pad - k)))
    store_dtype = _store_dtype(out_dtype, k_splits)
    split_steps = k_pad // STEP_K // k_splits
    # at most the part's steps: a pipeline asked for more steps in flight than it has can hang
    depth = min(split_steps, _depth(m_tile, qw, store_dtype.itemsize, max_concurrent_steps))
    per_channel = is_per_channel(qw)
    gps = _groups_per_step(qw)                          # groups in a step (1: a step within a group)
    steps_per_group = max(1, qw.group_size // STEP_K)
    zero_point, offsets = qw.zero_point, qw.zeros is not None and not qw.zero_point
    two_level = qw.two_level
    steps_per_super = qw.super_group // STEP_K if two_level else 1
    staged = bool(interpret)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    # the row operands after w and x, in order: scales, [zeros or offsets], [super scales], [super offsets]
    names = ["s"] + (["z"] if qw.zeros is not None else []) + (["ss"] if two_level else []) + (
        ["sz"] if two_level and qw.zeros is not None else [])

    def kernel(w_gmem, x_gmem, *refs):
        row_gmem = dict(zip(names, refs))
        out_gmem, out_smem, *a_smem = refs[len(names):]
        wg = lax.axis_index("wg")
        m_idx, n_idx = lax.axis_index("m"), lax.axis_index("n")
        part = lax.axis_index("k")
        first = part * split_steps   # this block's first K step (a multiple of its group and super-group steps)
        out_part = out_gmem.at[part] if k_splits > 1 else out_gmem
        cols = pl.ds(n_idx * BLOCK_N, BLOCK_N)
        mine = pl.ds(wg * WG_ROWS, WG_ROWS)

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((WG_ROWS, m_tile), jnp.float32))
            def _(acc_ref):
                no_scale = plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), row_layout)
                _, scale = eval_pipeline((acc_ref, no_scale))
                y = acc_ref[...]
                if per_channel:
                    y = y * lax.broadcast_in_dim(scale, y.shape, [0])
                out_smem.at[wg].T[...] = plgpu.layout_cast(y.astype(store_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_part.at[pl.ds(m_idx * m_tile, m_tile),
                                                                     pl.ds(n_idx * BLOCK_N + wg * WG_ROWS, WG_ROWS)])
                plgpu.wait_smem_to_gmem(0)

        def step(_, w_smem, x_smem, *rest):
            row_smem, (acc_ref, _) = dict(zip(names, rest[:-1])), rest[-1]

            def row(name, j=0):   # row j of this step's group rows, f32 [64] (two levels multiplied out)
                r = plgpu.load(row_smem[name].at[j, mine], layout=row_layout).astype(jnp.float32)
                if two_level and name in ("s", "z"):
                    r = r * plgpu.load(row_smem["s" + name].at[0, mine], layout=row_layout).astype(jnp.float32)
                return r

            def per_group(f):   # [64, 128] bf16: group j's f32 row f(j) over its columns
                width = STEP_K // gps
                parts = [lax.broadcast_in_dim(f(j).astype(jnp.bfloat16), (WG_ROWS, width), [0]) for j in range(gps)]
                return parts[0] if gps == 1 else jnp.concatenate(parts, axis=1)

            s = row("s")
            if qw.format == "int4":   # zero points of one group: subtracted in the conversion
                z = row("z") if zero_point and gps == 1 else None
                a = mma_tile_to_bf16(w_smem[mine], z, interpret=staged)
                if zero_point and gps > 1:
                    a = a - per_group(lambda j: row("z", j))
            else:
                a = codes_as_bf16(w_smem[mine])
            if not per_channel:   # the group scales (and offsets, w = (q + 8) s + zeros), rounded to bf16
                a = a * per_group(lambda j: row("s", j))
                if offsets:
                    a = a + per_group(lambda j: 8.0 * row("s", j) + row("z", j))
            if staged:
                a_smem[0].at[wg][...] = a
                plgpu.commit_smem()
                a = a_smem[0].at[wg]
            plgpu.wgmma(acc_ref, a, x_smem.T)
            plgpu.wgmma_wait(0)
            return acc_ref, s

        w_bits = elem_bits(qw.qweight.dtype)
        if per_channel:   # the one scale row, fetched again each step (512 bytes; the warp-specialized
            row_specs = [plgpu.BlockSpec((1, BLOCK_N), lambda k: (k * 0, 0))]   # pipeline takes only blocks that move)
        else:
            group_rows = plgpu.BlockSpec((gps, BLOCK_N), lambda k: (k // steps_per_group, 0))
            super_rows = plgpu.BlockSpec((1, BLOCK_N), lambda k: (k // steps_per_super, 0))
            row_specs = [group_rows if name in ("s", "z") else super_rows for name in names]
        in_specs = [plgpu.BlockSpec((BLOCK_N, STEP_K), lambda k: (0, k),
                                    transforms=swizzled(STEP_K * w_bits, w_bits, "weight")),
                    plgpu.BlockSpec((m_tile, STEP_K), lambda k: (0, k), transforms=swizzled(STEP_K * 16, 16, "x"))]
        ks = pl.ds(first * STEP_K, split_steps * STEP_K)   # this block's part of K, then its part of each row operand
        operands = [w_gmem.at[cols, ks], x_gmem.at[pl.ds(m_idx * m_tile, m_tile), ks]]
        for name in names:
            if per_channel:
                rows_of_part = slice(None)
            elif name in ("s", "z"):
                rows_of_part = pl.ds(first * gps // steps_per_group, split_steps * gps // steps_per_group)
            else:
                rows_of_part = pl.ds(first // steps_per_super, split_steps // steps_per_super)
            operands.append(row_gmem[name].at[rows_of_part, cols])
        plgpu.emit_pipeline_warp_specialized(
            step, grid=(split_steps,), memory_registers=MEMORY_REGISTERS, in_specs=in_specs + row_specs,
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=depth, compute_context=compute_context,
        )(*operands)

    scratch = [plgpu.SMEM((2, m_tile, WG_ROWS), store_dtype)]
    if staged:
        scratch.append(plgpu.SMEM((2, WG_ROWS, STEP_K), jnp.bfloat16, transforms=swizzled(STEP_K * 16, 16, "a")))
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((k_splits,) * (k_splits > 1) + (m_pad, n_pad), store_dtype),
        grid=(m_pad // m_tile, n_pad // BLOCK_N, k_splits), grid_names=("m", "n", "k"), num_threads=3,
        thread_name="wg", scratch_types=scratch,
        interpret=interpret_params(interpret), kernel_name=f"rows_matmul_{qw.format}",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    arrays = {"s": qw.scales, "z": qw.zeros, "ss": qw.super_scales, "sz": qw.super_zeros}
    y = call(qw.qweight, xp, *(arrays[name] for name in names))
    if k_splits > 1:
        y = y.sum(0).astype(out_dtype)
    return y[:m, :qw.shape[1]]

"""Fused dequantize-matmul for weight-only quantized linears (W8A16 int8/fp8, W4A16 int4).

y[M, N] = x[M, K] @ W[K, N], W a `atlasjax.quantization.QuantizedWeight`.

Kernel (Mosaic GPU, Hopper wgmma), "swap AB": the weight is stored [N, K] (K contiguous), so the
kernel computes y.T = W.T @ x.T. Each warpgroup owns 64 output channels; per K step it
1. TMA-loads the quantized tile W.T[64, tile_k] and x[m_pad, tile_k] into shared memory
   (a `plgpu.emit_pipeline`, several steps in flight: decode is a stream over the weight);
2. converts the tile to bf16 in registers (int8/int4/fp8 -> bf16 is exact; Mosaic GPU picks the
   fast conversions; int4 stored in mma order converts a 32-bit word per eight weights,
   pallas_kernels/int4_mma_order.py) and issues one wgmma with it as the register A operand and
   x.T as the shared-memory B operand (M of the product = 64 weight rows, N = m_pad >= 8 activation rows);
3. multiplies the step's f32 partial by the group's scale row and adds it to the carry.
A step covers `group_unroll` groups (2 by default), whose wgmmas are all issued before one wait,
so dequantizing a group overlaps the previous group's wgmma; in mma order the step's groups are
one TMA tile (wider weight rows stream faster).
Groups under 128 elements (GGUF's 32) can instead multiply the dequantized tile by its groups'
scales in registers before the wgmma ("prescale"), so a step spans several groups and one
accumulator serves all of K; int4 groups of 32 in natural order need that (a 16-byte row is under
the smallest swizzle). In mma order 8 of them load as one 128-byte row and take the per-group path
(`default_config`: up to 16 rows), whose float offsets can come from x's group sums (`x_sums`).
Two-level group rows (GGUF Q4_K: uint8 codes under float16 rows per 256) take either path: a step
also loads the super rows over its groups and multiplies each group's row by its super row (per
column, in f32).
The dequantized weight never leaves registers. K is split across a second grid axis when the
N tiles alone cannot fill the GPU; the f32 split partials are summed by XLA (they are tiny).
Asymmetric int4 with integer zero points (what quantize at load makes) subtracts each group's
zero-point row from the dequantized tile (q - z is exact in bf16), so it costs one packed subtract
per two weights and no more wgmmas (in mma order, none: the conversion's own subtract takes it).
With float offsets (GGUF Q4_1) the offset term
sum_g (8 s + zeros)[g, n] * sum_{k in g} x[m, k] stays in the kernel (`fold_zeros`): prescaled
steps add the offsets to the tile; per-group steps run one more wgmma per group, of a ones tile
with x, whose rows are the group's x row sums (exact in f32, and no division by a scale, which is
0 for a constant group). `fold_zeros=False` leaves the term to XLA next to the kernel.

Past 32 rows a warp-specialized kernel of its own runs int4 (every grouping) and 8-bit codes up to
1,024 rows (rows_matmul.py, `rows_matmul.pays`; int4 g128 0.6-1.2x the bf16 dot at 256-2,048 rows
on the 8B's shapes, where this kernel ran 0.8-1.8x; at 64-128 rows this kernel was 1.1-1.6x
slower), with its tile and K split from `rows_matmul.plan_for`. Weights it does not take run this
kernel as one M tile up to DECODE_ROWS and in M tiles of 128 rows past that up to
`fused_max_rows` (256-768 by format); above that, and for 8-bit codes
past 1,024 rows, the weight dequantized to bf16 as stored (W.T) for XLA's GEMM, which writes bf16
itself (`dequantized_dot`), measured faster (docs/perf_quant.md, sessions 37 and 84; per channel at
2,048 rows a weight of up to 4096x4096 keeps XLA's convert-fused GEMM: `convert_fused_pays`).
`prefill=` forces any of the paths.

Per-channel int8 / fp8 take a third path on the GPU, `backend="xla"`: y = (x @ convert(Wq)) * s.
XLA fuses the int8/fp8 -> bf16 convert into its own (Triton) GEMM, which then streams the 1-byte
weight; the channel scale multiplies the f32 output and fuses into whatever consumes it. On the
H100 with the engine's 8 decode rows it beat the Pallas kernel on every 8B shape (4096x28672:
43.6 vs 49.7 us, 89% of copy), and it takes the 128 quantized-matmul custom calls out of an 8B step.
Grouped formats cannot take it: XLA materializes a dequantized weight when the scale varies along K.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int8_mma_matmul as int8_mma
from pallas_kernels import rows_matmul as rows_kernel
from pallas_kernels import w8a8
from pallas_kernels.gemm_tiling import SMEM_BUDGET, elem_bits, interpret_params, k_splits, swizzled
from pallas_kernels.int4_mma_order import mma_tile_to_bf16
from pallas_kernels.quant_format import (  # noqa: F401 (is_per_channel re-exported)
    QuantizedWeight, codes_as_bf16, dequantize, dequantize_nk, group_offsets, is_per_channel, permuted_like_mma_order)
from pallas_kernels.quantized_matmul_rules import (  # noqa: F401 (MAX_TILE_M, TILE_N re-exported)
    MAX_TILE_M, TILE_N, QuantMatmulConfig, _can_use_pallas, _folds_zeros, _prescales, _tile_k, _unroll,
    _xla_offsets, convert_fused_pays, default_config, fused_max_rows)

DECODE_ROWS = 128  # up to this many rows (a decode batch) the fused kernel runs as one M tile


def quantized_matmul_kernel(w_gmem, x_gmem, s_gmem, out_gmem, out_smem, a_smem=None, *, tile_k, m_tile,
                            steps_per_split, steps_per_group, per_channel, max_concurrent_steps,
                            prescale=False, group_size=None, unroll=1, z_gmem=None, zero_point=False,
                            mma_order=False, prescale_bf16=False, ss_gmem=None, sz_gmem=None, super_group=None,
                            xs_gmem=None):
    """One (N tile, M tile, K split) block: out[split, m_tile, n_tile] = sum over its K steps.

    Refs: w_gmem [N_pad, K_pad] quantized; x_gmem [M_pad, K_pad] bf16; s_gmem (z_gmem) [G, N_pad]
    scales (integer zero points with `zero_point`, else float offsets to fold in), any float
    dtype, or uint8 codes under ss_gmem (sz_gmem) [S, N_pad] two-level super-group rows; xs_gmem [G, M_pad] f32 or None: x's sum over each group, for float offsets on the
    per-group path (instead of a ones-tile wgmma per group); out_gmem [splits, M_pad, N_pad] f32 (the
    output dtype when K is not split); out_smem
    [m_tile, TILE_N] of out_gmem's dtype; a_smem [TILE_N, tile_k] bf16 scratch or None: when given
    (interpret mode, whose wgmma reads only shared memory), the dequantized tile is staged there
    instead of feeding wgmma from registers.
    """
    n_idx, m_idx, split = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("split")
    n_slice = pl.ds(n_idx * TILE_N, TILE_N)
    m_slice = pl.ds(m_idx * m_tile, m_tile)
    first_step = split * steps_per_split
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    w_bits = elem_bits(w_gmem.dtype)

    def load_row(rows_smem, i):  # row i of a group-rows tile, as f32 [TILE_N] (stored f32, bf16 or f16)
        return plgpu.load(rows_smem.at[i], layout=row_layout).astype(jnp.float32)

    def dequantized(w_smem):  # [TILE_N, tile_k] -> bf16 registers; exact for int8/int4/e4m3
        if mma_order:  # int4 in mma order: one word per 8 weights
            return mma_tile_to_bf16(w_smem[...], interpret=a_smem is not None)
        return codes_as_bf16(w_smem[...])

    def issue(acc_ref, a, x_smem):  # a: the [TILE_N, tile_k] bf16 weight tile in registers
        if a_smem is not None:  # interpret mode runs each wgmma at once, so one staging tile serves all
            a_smem[...] = a
            plgpu.commit_smem()
            a = a_smem
        plgpu.wgmma(acc_ref, a, x_smem.transpose((1, 0)))

    def mma(acc_ref, a, x_smem):
        issue(acc_ref, a, x_smem)
        plgpu.wgmma_wait(0)  # x_smem is released to the pipeline when the step returns

    def in_specs():  # one weight and one x tile per step (the per-group path builds its own)
        return [plgpu.BlockSpec((TILE_N, tile_k), lambda k: (0, first_step + k),
                                transforms=swizzled(tile_k * w_bits, w_bits, "weight")),
                plgpu.BlockSpec((m_tile, tile_k), lambda k: (0, first_step + k),
                                transforms=swizzled(tile_k * 16, 16, "x"))]
    operands = (w_gmem.at[n_slice], x_gmem.at[m_slice])
    scale_spec = plgpu.BlockSpec((1, TILE_N), lambda k: ((first_step + k) // steps_per_group, 0))
    groups_per_step = max(1, tile_k // group_size) if prescale else 1
    if prescale and groups_per_step > 1:  # the step's groups: rows [k * gps, (k + 1) * gps) of the scales
        scale_spec = plgpu.BlockSpec((groups_per_step, TILE_N), lambda k: (first_step + k, 0))
    # Two-level rows: the super rows over a step of step_k elements (one, indexed by step, when a
    # super-group spans several steps); group j of the step sits under its super row
    # j * group_size // super_group.
    super_gmem = [r.at[:, n_slice] for r in (ss_gmem, sz_gmem) if r is not None]

    def super_specs(step_k):
        if not super_gmem:
            return []
        return [plgpu.BlockSpec((max(1, step_k // super_group), TILE_N),
                                lambda k: ((first_step + k) // max(1, super_group // step_k), 0))] * len(super_gmem)

    def step_rows(rows):  # a step's row refs (scales, [zeros], [super scales], [super zeros], [x sums]) by name
        rows = list(rows)
        return (rows.pop(0), rows.pop(0) if z_gmem is not None else None, rows.pop(0) if ss_gmem is not None else None,
                rows.pop(0) if sz_gmem is not None else None, rows.pop(0) if rows else None)

    def per_group(row, shape, f=lambda r: r):  # row(j): [TILE_N] f32 -> shape: f(row j) over group j's columns
        # Each group's row broadcast over its own columns, joined along K (in the WGMMA layout that
        # only places registers). Measured as fast as the chain of whole-tile selects it replaced
        # (session 33): the compiler had resolved those per register already.
        width = shape[1] // groups_per_step
        parts = [lax.broadcast_in_dim(f(row(j)), (shape[0], width), [0]) for j in range(groups_per_step)]
        return parts[0] if groups_per_step == 1 else jnp.concatenate(parts, axis=1)

    def prescaled(w_smem, s_row, z_row=None):  # the tile times its groups' scales, rounded once to bf16
        if prescale_bf16:
            return prescaled_bf16(w_smem, s_row, z_row)
        a = dequantized(w_smem).astype(jnp.float32)
        if zero_point:  # w = (q - z) s
            return ((a - per_group(z_row, a.shape)) * per_group(s_row, a.shape)).astype(jnp.bfloat16)
        a = a * per_group(s_row, a.shape)
        if z_row is not None:  # w = q s + (8 s + zeros)
            a = a + per_group(lambda j: z_row(j) + 8.0 * s_row(j), a.shape)
        return a.astype(jnp.bfloat16)

    def prescaled_bf16(w_smem, s_row, z_row=None):  # as `prescaled`, in bf16: q (or q - z) exact, times s
        def bf16(r):
            return r.astype(jnp.bfloat16)
        a = dequantized(w_smem)
        if zero_point:
            return (a - per_group(z_row, a.shape, bf16)) * per_group(s_row, a.shape, bf16)
        a = a * per_group(s_row, a.shape, bf16)
        if z_row is not None:   # w = q s + (8 s + zeros)
            a = a + per_group(lambda j: z_row(j) + 8.0 * s_row(j), a.shape, bf16)
        return a

    if prescale and not per_channel:
        def rows_of(smem, super_smem):  # group j's f32 row (multiplied out of two levels)
            if super_smem is None:
                return lambda j: load_row(smem, j)
            supers = [load_row(super_smem, i) for i in range(max(1, groups_per_step * group_size // super_group))]
            return lambda j: load_row(smem, j) * supers[j * group_size // super_group]

        def step_prescaled(acc_ref, w_smem, x_smem, *rows):
            s_smem, z_smem, ss_smem, sz_smem, _ = step_rows(rows)
            z_row = None if z_smem is None else rows_of(z_smem, sz_smem)
            mma(acc_ref, prescaled(w_smem, rows_of(s_smem, ss_smem), z_row), x_smem)

        group_rows = [s_gmem.at[:, n_slice]] + ([] if z_gmem is None else [z_gmem.at[:, n_slice]])

        def body_prescaled(acc_ref):
            plgpu.emit_pipeline(
                lambda _, *refs: step_prescaled(acc_ref, *refs),
                grid=(steps_per_split,),
                in_specs=in_specs() + [scale_spec] * len(group_rows) + super_specs(tile_k),
                max_concurrent_steps=max_concurrent_steps,
            )(*operands, *group_rows, *super_gmem)
            return acc_ref[...]

        acc = pl.run_scoped(body_prescaled, plgpu.ACC((TILE_N, m_tile), jnp.float32))
    elif per_channel:
        # One accumulator for all K steps; the channel scale is applied once at the end.
        def step_per_channel(acc_ref, w_smem, x_smem, s_smem, scale):
            del scale
            mma(acc_ref, dequantized(w_smem), x_smem)
            return load_row(s_smem, 0)  # the carry: [TILE_N] scales

        def body(acc_ref):
            scale = plgpu.emit_pipeline(
                lambda _, *refs: step_per_channel(acc_ref, *refs),
                grid=(steps_per_split,), in_specs=in_specs() + [scale_spec],
                max_concurrent_steps=max_concurrent_steps,
                init_carry=plgpu.layout_cast(jnp.zeros((TILE_N,), jnp.float32), row_layout),
            )(*operands, s_gmem.at[:, n_slice])
            part = acc_ref[...]
            return part * lax.broadcast_in_dim(scale, part.shape, [0])

        acc = pl.run_scoped(body, plgpu.ACC((TILE_N, m_tile), jnp.float32))
    else:
        # K groups: a step covers `unroll` whole groups (or part of one, when tile_k < group_size).
        # All of the step's wgmmas are issued before one wait, so the dequantization of a group
        # overlaps the previous group's wgmma; each group's f32 partial is then scaled by its row.
        # Integer zero points are subtracted from each group's tile. Float offsets with fold_zeros
        # run one more wgmma, of a ones tile with x: its every row is the group's x row sum, which
        # times the offset row (8 s + zeros) is the offset term.
        fold = z_gmem is not None and not zero_point
        # the offset term from x's group sums (xs_gmem) or from a ones-tile wgmma per group
        ones_mma = fold and xs_gmem is None
        ones = jnp.ones((TILE_N, tile_k), jnp.bfloat16) if ones_mma else None
        # int4 in mma order loads a step's groups as one tile (128-byte weight rows for two groups of
        # 128: docs/perf_quant.md, session 14); otherwise one tile per group.
        wide = unroll if mma_order else 1
        tiles = unroll // wide   # TMA tiles of weight (and of x) per step
        specs = ([plgpu.BlockSpec((TILE_N, tile_k * wide), lambda k, i=i: (0, (first_step + k) * tiles + i),
                                  transforms=swizzled(tile_k * wide * w_bits, w_bits, "weight")) for i in range(tiles)]
                 + [plgpu.BlockSpec((m_tile, tile_k * wide), lambda k, i=i: (0, (first_step + k) * tiles + i),
                                    transforms=swizzled(tile_k * 16, 16, "x")) for i in range(tiles)])
        # unroll > 1 only with one group per tile (steps_per_group == 1): rows [k * unroll, (k + 1) * unroll)
        rows_spec = scale_spec if unroll == 1 else plgpu.BlockSpec((unroll, TILE_N), lambda k: (first_step + k, 0))
        group_rows = [s_gmem.at[:, n_slice]] + ([] if z_gmem is None else [z_gmem.at[:, n_slice]])
        row_specs = [rows_spec] * len(group_rows) + super_specs(tile_k * unroll)
        group_rows += super_gmem
        if xs_gmem is not None and fold:   # [unroll, m_tile] group sums per step
            group_rows.append(xs_gmem.at[:, m_slice])
            row_specs.append(plgpu.BlockSpec((unroll, m_tile), lambda k: (first_step + k, 0)))

        def row(rows_smem, i, shape, dtype=jnp.float32):
            return lax.broadcast_in_dim(load_row(rows_smem, i).astype(dtype), shape, [0])

        def sums(xs_smem, i, shape):   # group i's x sums [m_tile], broadcast over the TILE_N rows
            col = plgpu.load(xs_smem.at[i], layout=plgpu.Layout.WGMMA.reduce(0))
            return lax.broadcast_in_dim(col, shape, [1])

        def tile(ws, z_smem, i, w_wide=None):  # group i's weight tile in bf16: q, or q - z (exact) with zero points
            if mma_order:
                z = load_row(z_smem, i) if zero_point else None
                return mma_tile_to_bf16(w_wide, z, parts=wide, part=i, interpret=a_smem is not None)
            a = dequantized(ws[i])
            return a - row(z_smem, i, a.shape, jnp.bfloat16) if zero_point else a

        def x_tile(xs, i):  # group i's [m_tile, tile_k] activations
            return xs[i] if wide == 1 else xs[0].at[:, pl.ds(i * tile_k, tile_k)]

        def step(_, *refs):
            ws, xs, acc = refs[:tiles], refs[tiles:2 * tiles], refs[-1]
            s_smem, z_smem, ss_smem, sz_smem, xs_smem = step_rows(refs[2 * tiles:-1])
            w_wide = ws[0][...] if mma_order else None   # loaded once, converted group by group

            def issue_all(*acc_refs):
                for i in range(unroll):
                    issue(acc_refs[i], tile(ws, z_smem, i, w_wide), x_tile(xs, i))
                    if ones_mma:
                        issue(acc_refs[unroll + i], ones, x_tile(xs, i))
                plgpu.wgmma_wait(0)
                return [r[...] for r in acc_refs]

            def two_level(rows_smem, super_smem, i):   # group i's f32 row, broadcast over the tile
                r = row(rows_smem, i, acc.shape)
                return r if super_smem is None else r * row(super_smem, i * group_size // super_group, acc.shape)

            parts = pl.run_scoped(issue_all, *[plgpu.ACC((TILE_N, m_tile), jnp.float32)] * (unroll * (1 + ones_mma)))
            for i in range(unroll):
                scale = two_level(s_smem, ss_smem, i)
                acc = acc + parts[i] * scale
                if fold:
                    offset = 8.0 * scale + two_level(z_smem, sz_smem, i)
                    acc = acc + (parts[unroll + i] if ones_mma else sums(xs_smem, i, acc.shape)) * offset
            return acc

        acc = plgpu.emit_pipeline(
            step, grid=(steps_per_split,),
            in_specs=specs + row_specs,
            max_concurrent_steps=max_concurrent_steps,
            init_carry=plgpu.layout_cast(jnp.zeros((TILE_N, m_tile), jnp.float32), plgpu.Layout.WGMMA),
        )(*([w_gmem.at[n_slice]] * tiles + [x_gmem.at[m_slice]] * tiles), *group_rows)
    # Stored as y [M, N] (a transposed view of the [m_tile, TILE_N] scratch; WGMMA_TRANSPOSED keeps
    # each register pair along N, the scratch's contiguous dim), so no XLA transpose follows.
    out_smem.T[...] = plgpu.layout_cast(acc.astype(out_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, m_slice, n_slice])
    plgpu.wait_smem_to_gmem(0)


def _pallas_matmul(xp, qw: QuantizedWeight, config: QuantMatmulConfig, m_tile: int, interpret, out_dtype):
    """xp: [M_pad, K_pad] bf16, M_pad a multiple of m_tile. Returns y [M_pad, N_pad]: f32 (the K split
    partials summed), or out_dtype when K is not split."""
    k_pad, n_pad = qw.padded_shape
    m_pad = xp.shape[0]
    tile_k = _tile_k(qw, config)
    unroll = _unroll(qw, config, tile_k)
    num_steps = k_pad // (tile_k * unroll)
    num_blocks = (n_pad // TILE_N) * (m_pad // m_tile)
    # auto: each split keeps >= 8 tiles of K
    splits = k_splits(num_steps, num_blocks, requested=config.num_k_splits, max_auto=num_steps * unroll // 8)
    # Steps in flight: as many as asked that fit shared memory (a 128-row M tile of 256-element
    # steps holds 64 KB of x per step).
    fold = _folds_zeros(qw, config)
    with_zeros = fold or qw.zero_point  # the kernel reads the zeros rows
    # Without K splits or an XLA offset term to add, the kernel stores y in the output dtype.
    y_dtype = jnp.float32 if splits > 1 or _xla_offsets(qw, config) else out_dtype
    per_step = unroll * (m_tile * tile_k * 2 + TILE_N * tile_k * elem_bits(qw.qweight.dtype) // 8
                         + (2 if with_zeros else 1) * 8 * TILE_N * 4)
    fixed = TILE_N * m_tile * 4 + (TILE_N * tile_k * 2 if interpret else 0)
    depth = max(1, min(config.max_concurrent_steps, (SMEM_BUDGET - fixed) // per_step))
    kernel = functools.partial(
        quantized_matmul_kernel, tile_k=tile_k, m_tile=m_tile, steps_per_split=num_steps // splits,
        steps_per_group=max(1, qw.group_size // tile_k), per_channel=qw.num_groups == 1 and qw.zeros is None,
        max_concurrent_steps=depth, prescale=_prescales(qw, config), group_size=qw.group_size,
        unroll=unroll, zero_point=qw.zero_point, mma_order=qw.mma_order, prescale_bf16=config.prescale_bf16,
        super_group=qw.super_group if qw.two_level else None)
    # inputs after w, x, scales: the zeros when read, then the two-level super rows of each
    extra = (["z"] if with_zeros else []) + (["ss"] + (["sz"] if with_zeros else []) if qw.two_level else [])
    # float offsets on the per-group path: x's group sums from XLA (`x_sums`) or a ones-tile wgmma
    x_sums = fold and config.x_sums and not _prescales(qw, config)
    extra += ["xs"] if x_sums else []

    def quantized_matmul_kernel_refs(w, x, s, *refs):
        named = dict(zip(extra, refs))
        kernel(w, x, s, *refs[len(extra):], **{f"{name}_gmem": ref for name, ref in named.items()})
    call = plgpu.kernel(
        quantized_matmul_kernel_refs,
        out_type=jax.ShapeDtypeStruct((splits, m_pad, n_pad), y_dtype),
        scratch_types=[plgpu.SMEM((m_tile, TILE_N), y_dtype)] + ([
            plgpu.SMEM((TILE_N, tile_k), jnp.bfloat16, transforms=swizzled(tile_k * 16, 16, "a"))
        ] if interpret else []),
        # M first: one weight tile's M tiles launch next to each other, so all but the first read
        # it from L2 (H100, int4 g128, 2,048 rows: 4096 x 28672 1144 -> 1038 us, 14336 x 4096 561 -> 501)
        grid=(m_pad // m_tile, n_pad // TILE_N, splits),
        grid_names=("m", "n", "split"),
        interpret=interpret_params(interpret),
        kernel_name=f"quantized_matmul_{qw.format}",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    rows = {"z": qw.zeros, "ss": qw.super_scales, "sz": qw.super_zeros}
    if x_sums:   # [G, M_pad]: each group's sum of x, exact in f32 for bf16 x
        g = qw.group_size
        rows["xs"] = xp.astype(jnp.float32).reshape(m_pad, k_pad // g, g).sum(-1).T
    y = call(qw.qweight, xp, qw.scales, *(rows[name] for name in extra))
    return y[0] if splits == 1 else y.sum(axis=0)


# ---------------------------------------------------------------------------------------------
# Public entry
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("backend", "interpret", "out_dtype", "config", "prefill"))
def quantized_matmul(x: jax.Array, qw: QuantizedWeight, *, backend: str = "auto", interpret=False,
                     out_dtype=None, config: QuantMatmulConfig | None = None,
                     prefill: str = "auto") -> jax.Array:
    """y = x @ W for a quantized W.

    Args:
      x: [M, K] bf16 or f32 (computed as bf16 activations, f32 accumulation).
      qw: QuantizedWeight of logical shape (K, N). Per-channel fp8 / int8 with `activations` "fp8" /
        "int8": from `w8a8.MIN_ROWS` rows on, x is rounded per row to the weight's format and
        multiplied on the 8-bit tensor cores (pallas_kernels/w8a8.py), whatever the backend.
      backend: "pallas" (the Mosaic GPU kernel), "xla" (per-channel int8/fp8: the convert fused into
        XLA's GEMM, see `xla_convert_matmul`; other formats dequantize + dot), "reference"
        (dequantize + dot in f32), "int8_mma" (per-channel int8, up to 128 rows: the int8 tensor
        cores against a two-part split of x, pallas_kernels/int8_mma_matmul.py; experimental, not
        chosen by "auto": in the engine its activation split costs more than it saves), or "auto"
        (on a GPU "xla" for per-channel int8/fp8 and "pallas" otherwise; "pallas" when `interpret`
        is set; the reference elsewhere).
      interpret: False, True or plgpu.InterpretGPUParams(): run the kernel in interpret mode.
      out_dtype: dtype of y (default x.dtype).
      config: kernel tunables (default: `default_config(qw, M)`).
      prefill: past `rows_matmul.MIN_ROWS` (32) rows: "rows" (the warp-specialized kernel of
        rows_matmul.py for the weights it takes, `rows_matmul.fits`: int4 in mma order, 8-bit
        codes in groups or per channel), "auto" (that kernel where it measured faster,
        `rows_matmul.pays`; other weights as "pallas" up to `fused_max_rows(qw)` rows and "xla"
        above: whichever measured faster, docs/perf_quant.md), "pallas" (this module's fused
        kernel, one M tile up to DECODE_ROWS rows, tile_m rows per tile past that) or "xla" (past
        DECODE_ROWS: dequantize to bf16, then an XLA dot; per-channel int8 / fp8: XLA's
        convert-fused GEMM). Weights whose layout the kernel cannot stream (int4 groups of 32
        without prescale, K not a multiple of a step) also take the "xla" path.
    Returns:
      y: [M, N] in out_dtype.
    """
    config = default_config(qw, x.shape[0]) if config is None else config
    m, k = x.shape
    if k != qw.shape[0]:
        raise ValueError(f"x has K={k} but the weight is {qw.shape} (K, N)")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    backend_auto = backend == "auto"
    if backend == "auto":
        if interpret:
            backend = "pallas"
        elif jax.default_backend() == "gpu":
            backend = "xla" if is_per_channel(qw) else "pallas"
        else:
            backend = "reference"
    if backend not in ("pallas", "xla", "reference", "int8_mma"):
        raise ValueError(f"unknown backend {backend!r}")
    if prefill not in ("auto", "rows", "pallas", "xla"):
        raise ValueError(f"prefill must be 'auto', 'rows', 'pallas' or 'xla', got {prefill!r}")
    if w8a8.takes_quantized_activations(qw, m):   # the weight asks for W8A8 at this many rows, any backend
        return w8a8.w8a8_matmul(x, qw, out_dtype)
    if backend == "reference":
        return quantized_matmul_reference(x, qw).astype(out_dtype)
    if qw.mma_order and qw.format == "int8":   # its K permuted (for decode_matmul): permute x's alike
        x, qw = permuted_like_mma_order(jnp.pad(x, ((0, 0), (0, qw.padded_shape[0] - k))), qw)
        # its own fusion: fused into XLA's GEMM, the permutation made it ~3x slower at 8 rows (H100)
        x = lax.optimization_barrier(x)
        k = x.shape[1]
    rows_backend = backend == "pallas" or (backend_auto and backend == "xla")   # not a forced "xla"
    if m > rows_kernel.MIN_ROWS and prefill in ("auto", "rows") and rows_backend:
        m_tile, k_splits = rows_kernel.plan_for(m, qw, out_dtype)
        if rows_kernel.fits(qw, m_tile, out_dtype, k_splits) and (prefill == "rows" or rows_kernel.pays(qw, m)):
            return rows_kernel.rows_matmul(x, qw, m_tile=m_tile, k_splits=k_splits, out_dtype=out_dtype,
                                           interpret=interpret)
    if prefill in ("auto", "rows"):
        prefill = "pallas" if m <= fused_max_rows(qw) else "xla"
    if backend == "int8_mma":
        return int8_mma.int8_mma_matmul(x, qw, out_dtype=out_dtype, interpret=interpret)
    if backend == "xla" and convert_fused_pays(qw, m):
        return xla_convert_matmul(x, qw).astype(out_dtype)
    if backend == "xla" or (m > DECODE_ROWS and prefill == "xla") or not _can_use_pallas(qw, config):
        return dequantized_dot(x, qw, out_dtype)

    k_pad, n_pad = qw.padded_shape
    m_tile = -(-m // 8) * 8 if m <= DECODE_ROWS else min(config.tile_m, -(-m // 8) * 8)
    m_pad = -(-m // m_tile) * m_tile
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, m_pad - m), (0, k_pad - k)))  # [M_pad, K_pad]
    y = _pallas_matmul(xp, qw, config, m_tile, interpret, out_dtype)  # [M_pad, N_pad]
    if _xla_offsets(qw, config):  # asymmetric int4 with float offsets: w = q * s + (8 s + zeros)
        g = qw.group_size
        x_sums = xp.astype(jnp.float32).reshape(m_pad, k_pad // g, g).sum(-1)  # [M_pad, G]
        y = y + jnp.dot(x_sums, group_offsets(qw), precision=lax.Precision.HIGHEST)
    return y[:m, : qw.shape[1]].astype(out_dtype)


def xla_convert_matmul(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """y = (x @ convert_bf16(Wq)) * scale for per-channel int8 / fp8, in plain XLA ops. [M, N] f32.

    Both operands keep K minor (the weight is stored [N_pad, K_pad]), the convert is exact
    (int8 and e4m3 values are bf16 values) and the scale multiplies the f32 accumulator, so this
    computes what the Pallas kernel computes; on the GPU XLA fuses the convert into its GEMM.
    """
    k_pad, _ = qw.padded_shape
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, 0), (0, k_pad - x.shape[1])))
    y = lax.dot_general(xp, qw.qweight.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)
    return (y * qw.scales[0])[:, :qw.shape[1]]


def dequantized_dot(x: jax.Array, qw: QuantizedWeight, out_dtype, *, barrier: bool = False) -> jax.Array:
    """y = x @ W through a bf16 copy of W.T as stored ([N_pad, K_pad], every scale and offset
    multiplied in: `dequantize_nk`), with XLA's GEMM contracting both minor dims and rounding its
    f32 accumulator to a bf16 out_dtype itself. [M, N] in out_dtype. barrier: keep the copy out of
    XLA's GEMM fusion (a separate elementwise kernel, then cuBLAS)."""
    k_pad, _ = qw.padded_shape
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, 0), (0, k_pad - x.shape[1])))
    w = dequantize_nk(qw, jnp.bfloat16)
    if barrier:
        w = lax.optimization_barrier(w)
    acc = out_dtype if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32
    y = lax.dot_general(xp, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)
    return y[:, :qw.shape[1]].astype(out_dtype)


def quantized_matmul_reference(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """Plain jnp: dequantize W to f32, then x @ W with f32 accumulation. x: [M, K] -> [M, N] f32."""
    w = dequantize(qw, jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)

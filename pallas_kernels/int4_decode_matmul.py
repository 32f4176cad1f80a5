"""int4 decode matmul: y = prologue(x) @ W (+ residual) for the few rows of a decode step, W the
engine's int4 format (groups of 128 with integer zero points, or none; mma order), its K split
summed inside the kernel.

Why: the int4 kernel of pallas_kernels/quantized_matmul.py splits K over a grid axis on Llama-3.1-8B's
qkv, o_proj and down (4 splits each) and leaves the f32 partials to XLA, which sums them in a kernel
of its own (that kernel also takes the residual add); the input RMSNorm before qkv is one more XLA
kernel. So an int4 8B layer ran 12 kernels against fp8's 8 (H100 profile, session 29: the split sums
and adds 1.34 + 1.34 + 1.60 us, the norm 1.63 us per layer).

Here the blocks of one column tile's K splits form a cluster. Each streams its share of K as the
int4 kernel does (a pipeline of [64, 256] tiles holding two groups of 128 in mma order, converted in
registers with the zero point folded in; a wgmma per group and its f32 partial times the group's
scale row); then the others store their f32 products into the first block's shared memory
(pallas_kernels/cluster_sum.py) and the first adds them, scales each row by 1 / rms(x) (RMSNorm
prologue), rounds, adds the residual and stores y [M, N].

RMSNorm prologue (`norm_scale`): each step stages x * scale in bf16 for the product's wgmmas, and
x * x for a wgmma of a ones tile with it: that accumulator holds each row's partial sum of squares
in all its 64 rows, in the product's own layout, so the cluster sums it as it sums the product.

Measured (session 29, H100, 8 rows, notebooks/gpu_int4_decode_matmul.py; docs/performance.md): correct,
but slower than what it replaces, so it is opt-in (`ATLASJAX_INT4_DECODE=on`, `pays`):
- the cluster split costs more than XLA's sum kernel: o_proj 7.56 us in 4-block clusters (7.05 in
  2-block ones) against 7.03 for the int4 kernel + XLA's sum and residual add; down 16.75 against 15.11;
  qkv without the prologue 10.53 against 9.13 (both after XLA's norm). Unsplit (gate_up) it streams
  as fast as the int4 kernel (28.00 against 28.01 us), so the loss is in the clusters;
- the RMSNorm prologue adds 3.0 us to qkv and 10.2 us to gate_up: the int4 kernel waits for every
  step's wgmmas, so the staging of two activation tiles and a third wgmma lengthen each step;
- the 8B int4 bs=1 step with it (prologues included, `--num-scheduler-steps 4`): 2.764 / 2.763 ms
  against 2.362 / 2.369 without.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import cluster_sum
from pallas_kernels.decode_matmul import tile_epilogue
from pallas_kernels.decode_switches import int4_decode_on
from pallas_kernels.gemm_tiling import interpret_params, k_splits, swizzled
from pallas_kernels.int4_mma_order import mma_tile_to_bf16
from pallas_kernels.quant_format import QuantizedWeight, dequantize

TILE_N = 64           # output columns per cluster: the M of one wgmma
GROUP = 128           # the group size it takes (quantize at load's default)
STEP_K = 2 * GROUP    # K per pipeline step: two groups, one 128-byte weight row per tile row
MAX_ROWS = 32         # decode rows
MAX_SPLITS = 8        # blocks per cluster (the portable cluster size)
MAX_DEPTH = 4         # pipeline steps in flight


def takes(m: int, qw) -> bool:
    """Whether `int4_decode_matmul` can compute x[m, K] @ qw."""
    if not (isinstance(qw, QuantizedWeight) and qw.format == "int4"):
        return False
    k_pad, n_pad = qw.padded_shape
    return (qw.mma_order and qw.group_size == GROUP and (qw.zeros is None or qw.zero_point)
            and 0 < m <= MAX_ROWS and n_pad % TILE_N == 0 and k_pad % STEP_K == 0
            and qw.scales.shape == (k_pad // GROUP, n_pad))


def pays(m: int, x_dtype, qw) -> bool:
    """Whether a model matmul on a GPU should run this kernel: only when asked
    (`ATLASJAX_INT4_DECODE=on`: the 8B int4 step was slower with it, 2.76 against 2.36 ms, session 29),
    for bf16 activations at decode rows and a weight it `takes`."""
    return int4_decode_on() and jnp.dtype(x_dtype) == jnp.bfloat16 and takes(m, qw)


def num_splits(qw: QuantizedWeight, requested: int | None = None) -> int:
    """K splits (blocks per cluster): the int4 kernel's choice (~2 blocks per SM, each split at least
    8 groups), at most MAX_SPLITS."""
    k_pad, n_pad = qw.padded_shape
    steps = k_pad // STEP_K
    requested = None if requested is None else min(requested, MAX_SPLITS)
    return k_splits(steps, n_pad // TILE_N, requested=requested, max_auto=min(MAX_SPLITS, steps // 4))


def int4_decode_kernel(*refs, k, steps, splits, norm, zero_point, with_residual, eps, interpret):
    """One block: K steps [part * steps, (part + 1) * steps) of column tile n; the cluster's first
    block (part 0) sums the cluster's products and runs the epilogue.

    Refs, in order: w [N, K] int4 (mma order); x [m, K] bf16; scales [G, N]; zero points [G, N]
    (zero_point); norm scale [K] bf16 (norm); residual [m, N] (with_residual); out [m, N]; in
    interpret mode with splits > 1 a spill output [splits - 1, 2, N, m] f32 (cluster_sum.py);
    scratch: out_smem [m, TILE_N]; x_stage and sq_stage [m, STEP_K] bf16 (norm); a_smem [TILE_N,
    GROUP] bf16 (interpret: its wgmma reads shared memory only); r_smem [m, TILE_N] and a barrier
    (with_residual); receive slots [TILE_N, m] f32, (splits - 1) x (1 + norm); in interpret mode
    with splits > 1, a barrier per slot and a cluster barrier.
    """
    refs = list(refs)
    take = lambda present: refs.pop(0) if present else None   # noqa: E731
    w_gmem, x_gmem, s_gmem = take(True), take(True), take(True)
    z_gmem, g_gmem, r_gmem = take(zero_point), take(norm), take(with_residual)
    out_gmem = take(True)
    spill_gmem = take(splits > 1 and interpret)
    out_smem = take(True)
    x_stage, sq_stage = take(norm), take(norm)
    a_smem = take(interpret)
    r_smem, r_barrier = take(with_residual), take(with_residual)
    sums = 1 + norm   # arrays the cluster sums: the product, and the sums of squares
    recv = [take(True) for _ in range((splits - 1) * sums)]
    spill_barriers = [take(True) for _ in range((splits - 1) * sums)] if splits > 1 and interpret else []
    cluster_barrier = take(splits > 1 and interpret)

    m = x_gmem.shape[0]
    part = lax.axis_index(cluster_sum.AXIS) if splits > 1 else 0
    leader = part == 0 if splits > 1 else None
    cols = pl.ds(lax.axis_index("n") * TILE_N, TILE_N)
    first = part * steps
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def fetch_residual():   # in flight while the weight streams
        plgpu.copy_gmem_to_smem(r_gmem.at[:, cols], r_smem, r_barrier)
    if with_residual and leader is None:
        fetch_residual()
    elif with_residual:
        pl.when(leader)(fetch_residual)

    rows_spec = plgpu.BlockSpec((2, TILE_N), lambda s: (first + s, 0))   # the step's two groups' rows
    specs = [plgpu.BlockSpec((TILE_N, STEP_K), lambda s: (0, first + s), transforms=swizzled(STEP_K * 4, 4, "weight")),
             plgpu.BlockSpec((m, STEP_K), lambda s: (0, first + s), transforms=swizzled(STEP_K * 16, 16, "x")),
             rows_spec]
    operands = [w_gmem.at[cols], x_gmem, s_gmem.at[:, cols]]
    if zero_point:
        specs.append(rows_spec)
        operands.append(z_gmem.at[:, cols])
    if norm:
        specs.append(plgpu.BlockSpec((STEP_K,), lambda s: (first + s,)))
        operands.append(g_gmem)

    def load_row(rows_smem, i):   # row i of a [2, TILE_N] rows tile as f32
        return plgpu.load(rows_smem.at[i], layout=row_layout).astype(jnp.float32)

    def issue(acc_ref, a, x_ref):   # a: a [TILE_N, GROUP] bf16 tile in registers; x_ref [m, GROUP]
        if a_smem is not None:
            a_smem[...] = a
            plgpu.commit_smem()
            a = a_smem
        plgpu.wgmma(acc_ref, a, x_ref.T)

    ones = jnp.ones((TILE_N, GROUP), jnp.bfloat16) if norm else None

    def step(_, w_smem, x_smem, s_smem, *rest):
        *rows, carry = rest
        z_smem = rows.pop(0) if zero_point else None
        acc, ssq = carry
        x_ref = x_smem
        if norm:   # x * scale for the product, x * x for the sums of squares
            g_smem = rows.pop(0)
            xt = plgpu.load(x_smem.T, layout=plgpu.Layout.WGMMA_TRANSPOSED).astype(jnp.float32)   # [STEP_K, m]
            x_stage.T[...] = (xt * g_smem[...].astype(jnp.float32)[:, None]).astype(jnp.bfloat16)
            sq_stage.T[...] = (xt * xt).astype(jnp.bfloat16)
            plgpu.commit_smem()
            x_ref = x_stage
        w_wide = w_smem[...]

        def issue_all(*acc_refs):
            for i in range(2):
                z = load_row(z_smem, i) if zero_point else None
                a = mma_tile_to_bf16(w_wide, z, parts=2, part=i, interpret=interpret)
                issue(acc_refs[i], a, x_ref.at[:, pl.ds(i * GROUP, GROUP)])
                if norm:
                    issue(acc_refs[2], ones, sq_stage.at[:, pl.ds(i * GROUP, GROUP)])
            plgpu.wgmma_wait(0)
            return [r[...] for r in acc_refs]

        products = pl.run_scoped(issue_all, *[plgpu.ACC((TILE_N, m), jnp.float32)] * (2 + norm))
        for i in range(2):
            acc = acc + products[i] * lax.broadcast_in_dim(load_row(s_smem, i), acc.shape, [0])
        return acc, (ssq + products[2] if norm else None)

    zeros = plgpu.layout_cast(jnp.zeros((TILE_N, m), jnp.float32), plgpu.Layout.WGMMA)
    acc, ssq = plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs, max_concurrent_steps=min(MAX_DEPTH, steps),
                                   init_carry=(zeros, zeros if norm else None))(*operands)

    def epilogue(acc, ssq):
        if norm:   # each row's 1 / rms(x), from all of K's sums of squares
            acc = acc * lax.rsqrt(ssq * (1.0 / k) + eps)
        tile_epilogue(acc, ssq=None, ws_smem=None, ws_barrier=None, r_smem=r_smem, r_barrier=r_barrier,
                      out_smem=out_smem, out_gmem=out_gmem.at[:, cols], k=k, prologue=None, eps=eps)

    if splits == 1:
        return epilogue(acc, ssq)
    arrays = [acc, ssq] if norm else [acc]

    def slot(p, j):   # where block p hands over array j
        spill = spill_gmem.at[p - 1, j, cols] if interpret else None
        return recv[(p - 1) * sums + j], spill, (spill_barriers[(p - 1) * sums + j] if interpret else None)

    for p in range(1, splits):
        def hand_over(p=p):
            for j, a in enumerate(arrays):
                ref, spill, _ = slot(p, j)
                cluster_sum.hand_over(a, ref, interpret=interpret, spill_gmem=spill)
        pl.when(part == p)(hand_over)
    cluster_sum.barrier(interpret=interpret, cluster_barrier=cluster_barrier)

    @pl.when(part == 0)
    def _():
        totals = list(arrays)
        for p in range(1, splits):
            for j in range(sums):
                ref, spill, barrier = slot(p, j)
                totals[j] = totals[j] + cluster_sum.take(ref, interpret=interpret, spill_gmem=spill,
                                                         spill_barrier=barrier)
        epilogue(totals[0], totals[1] if norm else None)


@functools.partial(jax.jit, static_argnames=("norm_eps", "out_dtype", "splits", "interpret"))
def int4_decode_matmul(x: jax.Array, qw: QuantizedWeight, residual: jax.Array | None = None, *,
                       norm_scale: jax.Array | None = None, norm_eps: float = 1e-6, out_dtype=None,
                       splits: int | None = None, interpret=False) -> jax.Array:
    """y = a @ W with f32 accumulation (+ residual), a = x, or RMSNorm(x) * norm_scale when given (x
    * norm_scale staged in bf16, each row of the product times 1 / rms(x) in f32, as
    decode_matmul's prologue computes). x [M, K] (M <= MAX_ROWS); qw an int4 weight `takes` (groups
    of 128, integer zero points or symmetric, mma order); residual None or [M, N], added to the
    product rounded to out_dtype. splits: blocks per cluster over K (None: `num_splits`). Returns
    [M, N] in out_dtype (default x.dtype)."""
    m, k = x.shape
    if not takes(m, qw):
        raise ValueError(
            f"int4_decode_matmul takes an int4 weight in mma order with groups of {GROUP} (integer zero points "
            f"or none), N_pad % {TILE_N} == 0, K_pad % {STEP_K} == 0, and 1 <= M <= {MAX_ROWS}; got M={m}, "
            f"{qw.format} groups of {qw.group_size}, padded shape {qw.padded_shape}")
    if k != qw.shape[0]:
        raise ValueError(f"x has K={k} but the weight is {qw.shape} (K, N)")
    n = qw.shape[1]
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"residual {residual.shape} is not the product's shape {(m, n)}")
    if norm_scale is not None and norm_scale.shape != (k,):
        raise ValueError(f"norm_scale {norm_scale.shape} is not x's row ({k},)")
    k_pad, n_pad = qw.padded_shape
    splits = num_splits(qw, splits)
    steps = k_pad // STEP_K // splits
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    norm = norm_scale is not None
    m_pad = -(-m // 8) * 8   # wgmma N: a multiple of 8
    operands = [qw.qweight, jnp.pad(x.astype(jnp.bfloat16), ((0, m_pad - m), (0, k_pad - k))), qw.scales]
    if qw.zero_point:
        operands.append(qw.zeros)
    if norm:
        operands.append(jnp.pad(norm_scale.astype(jnp.bfloat16), (0, k_pad - k)))
    if residual is not None:
        operands.append(jnp.pad(residual.astype(out_dtype), ((0, m_pad - m), (0, n_pad - n))))
    stage = plgpu.SMEM((m_pad, STEP_K), jnp.bfloat16, transforms=swizzled(STEP_K * 16, 16, "x"))
    scratch = [plgpu.SMEM((m_pad, TILE_N), out_dtype)] + [stage] * (2 * norm)
    if interpret:
        scratch.append(plgpu.SMEM((TILE_N, GROUP), jnp.bfloat16, transforms=swizzled(GROUP * 16, 16, "a")))
    if residual is not None:
        scratch += [plgpu.SMEM((m_pad, TILE_N), out_dtype), plgpu.Barrier(num_arrivals=1)]
    slots = (splits - 1) * (1 + norm)
    scratch += [plgpu.SMEM((TILE_N, m_pad), jnp.float32)] * slots
    out_type = jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype)
    spill = splits > 1 and bool(interpret)   # interpret mode hands the products over through HBM
    if spill:
        out_type = (out_type, jax.ShapeDtypeStruct((splits - 1, 2, n_pad, m_pad), jnp.float32))
        scratch += [plgpu.Barrier(num_arrivals=1)] * slots
        scratch.append(plgpu.ClusterBarrier(collective_axes=(cluster_sum.AXIS,)))
    call = plgpu.kernel(
        functools.partial(int4_decode_kernel, k=k, steps=steps, splits=splits, norm=norm,
                          zero_point=qw.zero_point, with_residual=residual is not None, eps=norm_eps,
                          interpret=bool(interpret)),
        out_type=out_type,
        scratch_types=scratch,
        grid=(n_pad // TILE_N,), grid_names=("n",),
        **(dict(cluster=(splits,), cluster_names=(cluster_sum.AXIS,)) if splits > 1 else {}),
        interpret=interpret_params(interpret),
        kernel_name="int4_decode_matmul",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    out = call(*operands)
    return (out[0] if spill else out)[:m, :n]


def int4_decode_matmul_reference(x: jax.Array, qw: QuantizedWeight, residual: jax.Array | None = None, *,
                                 norm_scale: jax.Array | None = None, norm_eps: float = 1e-6, out_dtype=None
                                 ) -> jax.Array:
    """Plain jnp, rounded where the kernel rounds: the activations (x * norm_scale) to bf16, the
    product in f32 (times 1 / rms(x)), then out_dtype, then the residual's sum."""
    xf = x.astype(jnp.float32)
    row_scale = 1.0
    if norm_scale is not None:
        row_scale = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)
        xf = xf * norm_scale.astype(jnp.float32)
    a = xf.astype(jnp.bfloat16).astype(jnp.float32)
    y = jnp.dot(a, dequantize(qw, jnp.float32), precision=lax.Precision.HIGHEST) * row_scale
    y = y.astype(out_dtype or x.dtype)
    return y if residual is None else residual.astype(y.dtype) + y

"""Decode matmul: y = prologue(x) @ W (+ residual) for the few rows of a decode step, W [K, N] bf16 as stored.

Why a kernel of our own when XLA's GEMM streams bf16 weights near copy bandwidth: at 8 rows XLA
splits K on the projections whose N is small (qkv, o_proj, down of an 8B model: split-K 4-8) and
sums the f32 partials in a second kernel, which also carries the residual add after o_proj and
down (~1.8 us each, 63 per Llama-3.1-8B step). This kernel streams each 64-column slice of W over
all of K in one block, so the product needs no second kernel, and adds the residual in its
epilogue. On the H100 it streams those shapes as fast as XLA's GEMM and the bf16 bs=1 step went
from 5.58 to 5.49-5.53 ms (notebooks/gpu_bf16_smem_gemv.py, docs/performance.md, session 18).
Without the epilogue add it did not pay: XLA then fused each add into the RMSNorm after it, and
that fused kernel was as slow as the two it replaced.

Kernel (Mosaic GPU, Hopper wgmma, "swap AB"): grid over N tiles of 64 columns, one warpgroup
each; `emit_pipeline` over K in steps of `tile_k` rows TMA-loads W[tile_k, 64] and x[m, tile_k]
into shared memory and issues wgmma(acc[64, m], W.T, x.T): the weight tile is the shared-memory
A operand (transposed view, no register copy) and the activations the B operand (wgmma N = m, a
multiple of 8). `wgmmas_in_flight` > 0 keeps that many wgmmas running across steps (the pipeline
delays releasing their tiles); only for tiles in shared memory, not for quantized tiles converted
in registers (`REGISTER_A_IN_FLIGHT`). The residual tile is fetched while the weight streams; the product
is rounded to the output dtype and then added, as `residual + x @ w` rounds.

Prologues (session 19): the kernel may compute its activations tile by tile from what XLA would
otherwise compute in a kernel of its own before it. Each step loads the activation tiles into
registers, computes, and stages the bf16 result in shared memory for the wgmma:
- RMSNorm (qkv after the input norm): stages x * scale and accumulates x * x; the epilogue scales
  each row of the product by 1 / rms(x). One kernel fewer per layer, at every decode row count;
- SwiGLU (down after silu(gate) * up, from the fused gate_up output): at <= 8 rows only, where it
  paid (1.7 us per call); at 16-32 rows converting 2 x rows x 2 values per thread and step of one
  warpgroup outlasted the weight's stream (52-122 us against 43).
On the H100 the bf16 bs=1 step went from 5.50 (kernel without prologues) to 5.45 ms, against 5.57
with XLA's GEMM (docs/performance.md, session 19). The models hand the kernel its prologue as a
deferred activation (models/deferred.py); `ATLASJAX_DECODE_PROLOGUE=off` computes them in XLA.

Quantized weights: per-channel int8 / fp8 tiles are converted to bf16 in registers and the
channel scales multiply the f32 product. (Grouped int4 ran here too, opt-in, until session 32
removed it: the 8B step took 3.35 ms with it, 2.36 with the int4 kernel; docs/performance.md,
session 30.)
With `k_split` 2 (pallas_kernels/cluster_sum.py) a column tile runs as a cluster of two blocks over
the halves of K; `tail_split_sms` splits only the tiles past the last full wave.

Where it runs, and in which config: pallas_kernels/decode_matmul_rules.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import cluster_sum, int8_mma_order
from pallas_kernels.decode_matmul_rules import (
    MAX_ROWS, NORM_MAX_TILE_K, REGISTER_A_IN_FLIGHT, TILE_N, DecodeMatmulConfig, default_config,
    weight_dtype)
from pallas_kernels.gemm_tiling import SMEM_BUDGET, elem_bits, interpret_params, swizzled
from pallas_kernels.quant_format import QuantizedWeight, codes_as_bf16, natural_codes

# Quantized weights: shared memory held per block, so that one block runs per SM (session 21, when
# the register-operand wgmmas above were left in flight; kept: the configs were tuned with it).
ONE_BLOCK_PER_SM_SMEM = 120 * 1024


def one_block_per_sm(used_smem: int) -> list:
    """Scratch that pads a block's shared memory (`used_smem` bytes) up to ONE_BLOCK_PER_SM_SMEM:
    unused, it keeps a second block off the SM."""
    pad = ONE_BLOCK_PER_SM_SMEM - used_smem
    return [plgpu.SMEM((pad,), jnp.int8)] if pad > 0 else []


def _stage_rms_norm(x_smem, g_smem, ssq):
    """x * scale for the wgmma (the row scale waits for the epilogue); x * x added to the carry."""
    x = plgpu.load(x_smem.T, layout=plgpu.Layout.WGMMA_TRANSPOSED).astype(jnp.float32)   # [tile_k, m]
    g = g_smem[...].astype(jnp.float32)
    return (x * g[:, None]).astype(jnp.bfloat16), ssq + x * x


def _stage_swiglu(gate_smem, up_smem):
    gate = plgpu.load(gate_smem.T, layout=plgpu.Layout.WGMMA_TRANSPOSED).astype(jnp.float32)
    up = plgpu.load(up_smem.T, layout=plgpu.Layout.WGMMA_TRANSPOSED).astype(jnp.float32)
    return (gate * jax.nn.sigmoid(gate) * up).astype(jnp.bfloat16)


def weight_tile_bf16(w_smem, mma_order: bool, interpret: bool):
    """A per-channel int8 / fp8 weight tile [TILE_N, tile_k] as bf16 codes in natural column order, in
    registers."""
    if mma_order:
        return int8_mma_order.mma_tile_to_bf16(w_smem[...], interpret=interpret)
    return codes_as_bf16(w_smem[...])


def _when(cond, fn):
    """fn() where cond holds (cond None: always, without a branch)."""
    if cond is None:
        fn()
    else:
        pl.when(cond)(fn)


def decode_matmul_kernel(*refs, k, tile_k, depth, in_flight, prologue, with_residual, eps, quantized,
                         stage_weight, k_split=1, split_from=0, mma_order=False, interpret=False):
    """One block: out[:, n tile] = prologue(x) @ w[:, n tile] over all of K (+ residual[:, n tile]);
    with `k_split` 2, a cluster of two blocks, each over half of K, the first adding the second's
    product before the epilogue (pallas_kernels/cluster_sum.py). With `split_from` > 0 the clusters
    before it run two whole tiles instead (block b of cluster q: tile 2q + b, all of K), and cluster
    q >= split_from splits tile split_from + q (the tail past the last full wave).

    Refs, in order: w_gmem, [K, N] bf16 (or, `quantized`, the per-channel int8 / fp8 weight stored
    [N, K]); x_gmem [m, K] (prologue "swiglu": [m, 2K], gate | up); scale_gmem [K] (prologue
    "rms_norm"); ws_gmem [1, N] f32 channel scales (quantized); r_gmem [m, N] (with_residual);
    out_gmem [m, N]; scratch out_smem [m, TILE_N]; staged_smem [in_flight + 1, m, tile_k] (with a
    prologue); ws_smem [TILE_N] and a barrier (quantized); staged_w_smem [in_flight + 1, TILE_N,
    tile_k] bf16 (stage_weight); r_smem [m, TILE_N] and a barrier (with_residual); then, quantized,
    unused padding (`ONE_BLOCK_PER_SM_SMEM`); k_split 2: recv_smem [TILE_N, m] f32, and in
    interpret mode a spill output [N, m] f32 (after out_gmem), its barrier and a cluster barrier.
    """
    refs = list(refs)
    take = lambda present: refs.pop(0) if present else None   # noqa: E731
    w_gmem, x_gmem = take(True), take(True)
    scale_gmem = take(prologue == "rms_norm")
    ws_gmem = take(quantized)
    r_gmem, out_gmem = take(with_residual), take(True)
    spill_gmem = take(k_split > 1 and interpret)
    out_smem = take(True)
    staged_smem = take(prologue is not None)
    ws_smem, ws_barrier = take(quantized), take(quantized)
    staged_w_smem = take(stage_weight)
    r_smem, r_barrier = take(with_residual), take(with_residual)
    recv_smem = take(k_split > 1)
    spill_barrier, cluster_barrier = take(k_split > 1 and interpret), take(k_split > 1 and interpret)

    m = x_gmem.shape[0]
    steps = k // tile_k
    q = lax.axis_index("n")
    whole = None   # (k_split 2, split_from > 0) whether this cluster's blocks each run a whole tile
    if k_split == 1:
        tile, leader, first_step, num_steps = q, None, 0, steps   # leader None: the only block
    else:
        part = lax.axis_index(cluster_sum.AXIS)   # which half of K
        tile, leader, first_step, num_steps = q, part == 0, part * (steps // 2), steps // 2
        if split_from:
            whole = q < split_from
            tile = jnp.where(whole, 2 * q + part, split_from + q)
            leader = whole | (part == 0)   # the block that runs its tile's epilogue
            first_step = jnp.where(whole, 0, first_step)
            num_steps = jnp.where(whole, steps, num_steps)   # a dynamic pipeline grid
    cols = pl.ds(tile * TILE_N, TILE_N)

    def fetch_epilogue_operands():   # in flight while the weight streams
        if with_residual:
            plgpu.copy_gmem_to_smem(r_gmem.at[:, cols], r_smem, r_barrier)
        if ws_gmem is not None:
            plgpu.copy_gmem_to_smem(ws_gmem.at[0, cols], ws_smem, ws_barrier)
    _when(leader, fetch_epilogue_operands)
    # Without a prologue the wgmma reads the x tile itself, so its release waits with the weight's.
    x_release = in_flight if prologue is None else 0
    # Each spec's step s reads K step first_step + s of the block's columns.
    if quantized:   # the wgmma reads the converted tile (registers or staged), not this one
        w_bits = elem_bits(w_gmem.dtype)
        w_spec = plgpu.BlockSpec((TILE_N, tile_k), lambda s: (0, first_step + s),
                                 transforms=swizzled(tile_k * w_bits, w_bits, "weight"))
        w_operand = w_gmem.at[cols, :]
    else:
        w_spec = plgpu.BlockSpec((tile_k, TILE_N), lambda s: (first_step + s, 0), delay_release=in_flight,
                                 transforms=swizzled(TILE_N * 16, 16, "weight"))
        w_operand = w_gmem.at[:, cols]
    x_spec = plgpu.BlockSpec((m, tile_k), lambda s: (0, first_step + s), delay_release=x_release,
                             transforms=swizzled(tile_k * 16, 16, "x"))
    specs = [w_spec, x_spec]
    operands = [w_operand, x_gmem.at[:, pl.ds(0, k)]]
    if prologue == "swiglu":   # gate and up tiles from the two halves of x
        specs.append(x_spec)
        operands.append(x_gmem.at[:, pl.ds(k, k)])
    elif prologue == "rms_norm":
        specs.append(plgpu.BlockSpec((tile_k,), lambda s: (first_step + s,)))
        operands.append(scale_gmem)

    def body(acc_ref):
        def step(idx, w_smem, *tiles):
            carry = None
            buffer = idx[0] % (in_flight + 1) if in_flight else 0   # of the staged tiles of this step
            if prologue is None:
                x_smem = tiles[0]
            else:   # the wgmma's activations, staged in shared memory (one buffer per wgmma in flight)
                if prologue == "rms_norm":
                    staged, carry = _stage_rms_norm(*tiles)
                else:
                    staged = _stage_swiglu(*tiles)
                x_smem = staged_smem.at[buffer]
                x_smem.T[...] = staged
            if not quantized:
                a = w_smem.T
            elif stage_weight:
                a = staged_w_smem.at[buffer]
                a[...] = weight_tile_bf16(w_smem, mma_order, interpret)
            else:
                a = weight_tile_bf16(w_smem, mma_order, interpret)
            if prologue is not None or stage_weight:
                plgpu.commit_smem()
            plgpu.wgmma(acc_ref, a, x_smem.T)
            plgpu.wgmma_wait(in_flight)
            return carry

        pipeline = plgpu.emit_pipeline(step, grid=(num_steps,), in_specs=specs, max_concurrent_steps=depth,
                                       init_carry=(jnp.zeros((tile_k, m), jnp.float32)
                                                   if prologue == "rms_norm" else None))
        ssq = pipeline(*operands)
        plgpu.wgmma_wait(0)
        return acc_ref[...], ssq

    acc, ssq = pl.run_scoped(body, plgpu.ACC((TILE_N, m), jnp.float32))
    epilogue = functools.partial(tile_epilogue, ssq=ssq, ws_smem=ws_smem, ws_barrier=ws_barrier, r_smem=r_smem,
                                 r_barrier=r_barrier, out_smem=out_smem, out_gmem=out_gmem.at[:, cols], k=k,
                                 prologue=prologue, eps=eps)
    if k_split == 1:
        return epilogue(acc)

    def sum_halves():   # both blocks of the cluster, then the first
        exchange = dict(interpret=interpret, spill_gmem=spill_gmem.at[cols] if interpret else None)
        _when(part == 1, lambda: cluster_sum.hand_over(acc, recv_smem, **exchange))
        cluster_sum.barrier(interpret=interpret, cluster_barrier=cluster_barrier)
        _when(part == 0, lambda: epilogue(acc + cluster_sum.take(recv_smem, spill_barrier=spill_barrier, **exchange)))
    if whole is None:
        sum_halves()
    else:
        _when(whole, lambda: epilogue(acc))
        _when(~whole, sum_halves)


def tile_epilogue(acc, *, ssq, ws_smem, ws_barrier, r_smem, r_barrier, out_smem, out_gmem, k, prologue, eps):
    """acc [TILE_N, m] f32 -> out_gmem [m, TILE_N]: channel scales, 1 / rms, rounding, residual."""
    if ws_smem is not None:   # each weight column's (output channel's) scale
        if ws_barrier is not None:   # None: already in shared memory
            plgpu.barrier_wait(ws_barrier)
        scale = plgpu.load(ws_smem, layout=plgpu.Layout.WGMMA.reduce(1))
        acc = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
    # y [m, N] through a transposed view of the [m, TILE_N] scratch (no XLA transpose after it)
    y = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
    if prologue == "rms_norm":   # each row's 1 / rms, from the sum of squares of its x
        y = y * lax.rsqrt(jnp.sum(ssq, axis=0) * (1.0 / k) + eps)[None, :]
    y = y.astype(out_smem.dtype)
    if r_smem is not None:   # rounded as `residual + (x @ w)` is: the product first, then the sum
        plgpu.barrier_wait(r_barrier)
        r = plgpu.load(r_smem.T, layout=plgpu.Layout.WGMMA_TRANSPOSED)
        y = (r.astype(jnp.float32) + y.astype(jnp.float32)).astype(out_smem.dtype)
    out_smem.T[...] = y
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("swiglu", "norm_eps", "out_dtype", "config", "interpret"))
def decode_matmul(x: jax.Array, w, residual: jax.Array | None = None, *,
                  norm_scale: jax.Array | None = None, norm_eps: float = 1e-6, swiglu: bool = False,
                  out_dtype=None, config: DecodeMatmulConfig | None = None, interpret=False) -> jax.Array:
    """y = a @ w with f32 accumulation (+ residual), where the activations a are
    - x itself: [M, K] bf16 (M <= MAX_ROWS);
    - norm_scale given: RMSNorm(x) * norm_scale, x [M, K], norm_scale [K]. The kernel stages
      x * norm_scale (rounded to bf16) for the wgmma and scales each row of the product by
      1 / rms(x) in f32: `x * (1/rms) * scale` rounded in another place than the unfused model's;
    - swiglu: silu(gate) * up (rounded to bf16 once), x = [M, 2K] holding gate | up.
    w: [K, N] bf16, or a per-channel int8 / fp8 `QuantizedWeight` of logical shape (K, N) stored
    without padding (`weight_dtype`), whose codes are converted to bf16 in the kernel and whose
    channel scales multiply the f32 product, as `xla_convert_matmul` computes. N a multiple of 64
    and K of the config's tile_k. residual: None or [M, N], added to the product rounded to
    out_dtype, as `residual + a @ w` rounds. Returns [M, N] in out_dtype (default x.dtype).
    config None: `default_config(N, swiglu, weight dtype, K)`."""
    if norm_scale is not None and swiglu:
        raise ValueError("decode_matmul takes one prologue: norm_scale or swiglu, not both")
    w_dtype = weight_dtype(w)
    if w_dtype is None:
        grouped = isinstance(w, QuantizedWeight) and w.num_groups > 1
        raise ValueError("decode_matmul takes a bf16 weight or a per-channel int8 / fp8 QuantizedWeight "
                         f"without padding; got {getattr(w, 'format', None) or w.dtype}"
                         + (f" in groups of {w.group_size}" if grouped else ""))
    quantized = isinstance(w, QuantizedWeight)
    m, k = x.shape
    k //= 2 if swiglu else 1
    n = w.shape[1]
    config = config or default_config(n, swiglu, w_dtype, k)
    stage_weight = quantized and (config.stage_weight or bool(interpret))
    if quantized and not stage_weight and config.wgmmas_in_flight > REGISTER_A_IN_FLIGHT:
        raise ValueError("a quantized weight's converted tile feeds the wgmma from registers, so each wgmma must "
                         "finish before the next tile is converted: wgmmas_in_flight 0, or stage_weight=True")
    if w.shape[0] != k or (swiglu and x.shape[1] != 2 * k):
        raise ValueError(f"x {x.shape} does not match the weight {tuple(w.shape)}" + (" (swiglu: x is gate | up)" if swiglu else ""))
    split = config.k_split
    if n % TILE_N or k % (split * config.tile_k) or not 0 < m <= MAX_ROWS:
        raise ValueError(f"decode_matmul needs N % {TILE_N} == 0, K % {split * config.tile_k} == 0 and "
                         f"1 <= M <= {MAX_ROWS}; got M={m}, K={k}, N={n}")
    if split > 1 and norm_scale is not None:
        raise ValueError("decode_matmul's RMSNorm prologue needs all of K in one block (k_split 1)")
    if config.tile_k > NORM_MAX_TILE_K and norm_scale is not None:
        raise ValueError(f"decode_matmul's RMSNorm prologue loads the norm scale in steps of at most "
                         f"{NORM_MAX_TILE_K} (one TMA box); got tile_k {config.tile_k}")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"residual {residual.shape} is not the product's shape {(m, n)}")
    if norm_scale is not None and norm_scale.shape != (k,):
        raise ValueError(f"norm_scale {norm_scale.shape} is not x's row ({k},)")
    prologue = "rms_norm" if norm_scale is not None else "swiglu" if swiglu else None
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m_pad = -(-m // 8) * 8    # wgmma N: a multiple of 8
    pad = ((0, m_pad - m), (0, 0))
    # shared memory per pipeline step: the weight tile, one x tile (gate and up for SwiGLU), the norm scale
    per_step = (config.tile_k * TILE_N * jnp.dtype(w_dtype).itemsize
                + ((1 + swiglu) * m_pad * config.tile_k + (prologue == "rms_norm") * config.tile_k) * 2)
    fixed = m_pad * TILE_N * out_dtype.itemsize * (1 if residual is None else 2) + quantized * TILE_N * 4
    # at most: the staged activations and weight tiles, one per wgmma in flight
    staged = (config.wgmmas_in_flight + 1) * config.tile_k * 2 * (m_pad * (prologue is not None) + TILE_N * stage_weight)
    fixed += (split > 1) * TILE_N * m_pad * 4   # the received product
    depth = max(1, min(config.max_concurrent_steps, k // (split * config.tile_k),
                       (SMEM_BUDGET - fixed - staged) // per_step))
    in_flight = min(config.wgmmas_in_flight, depth - 1)
    operands = [w.qweight if quantized else w.astype(jnp.bfloat16), jnp.pad(x.astype(jnp.bfloat16), pad)]
    if prologue == "rms_norm":
        operands.append(norm_scale.astype(jnp.bfloat16))
    if quantized:
        operands.append(w.scales.astype(jnp.float32))
    scratch = [plgpu.SMEM((m_pad, TILE_N), out_dtype)]
    if prologue:
        scratch.append(plgpu.SMEM((in_flight + 1, m_pad, config.tile_k), jnp.bfloat16,
                                  transforms=swizzled(config.tile_k * 16, 16, "x")))
    if quantized:
        scratch += [plgpu.SMEM((TILE_N,), jnp.float32), plgpu.Barrier(num_arrivals=1)]
    if stage_weight:
        scratch.append(plgpu.SMEM((in_flight + 1, TILE_N, config.tile_k), jnp.bfloat16,
                                  transforms=swizzled(config.tile_k * 16, 16, "a")))
    if residual is not None:
        operands.append(jnp.pad(residual.astype(out_dtype), pad))
        scratch += [plgpu.SMEM((m_pad, TILE_N), out_dtype), plgpu.Barrier(num_arrivals=1)]
    if split > 1:
        scratch.append(plgpu.SMEM((TILE_N, m_pad), jnp.float32))
    out_type = jax.ShapeDtypeStruct((m_pad, n), out_dtype)
    spill = split > 1 and bool(interpret)   # interpret mode hands the product over through HBM (cluster_sum.py)
    if spill:
        out_type = (out_type, jax.ShapeDtypeStruct((n, m_pad), jnp.float32))
        scratch += [plgpu.Barrier(num_arrivals=1), plgpu.ClusterBarrier(collective_axes=(cluster_sum.AXIS,))]
    # k_split 2: clusters of two blocks; with tail_split_sms, the first split_from of them run two
    # whole tiles (the full waves of blocks), the rest one split tile each
    tiles = n // TILE_N
    sms = config.tail_split_sms
    split_from = (tiles // sms * sms) // 2 if sms else 0
    used = fixed + staged + depth * per_step
    if quantized:
        scratch += one_block_per_sm(used)
    call = plgpu.kernel(
        functools.partial(decode_matmul_kernel, k=k, tile_k=config.tile_k, depth=depth, in_flight=in_flight,
                          prologue=prologue, with_residual=residual is not None, eps=norm_eps,
                          quantized=quantized, stage_weight=stage_weight, k_split=split, split_from=split_from,
                          mma_order=quantized and w.mma_order, interpret=bool(interpret)),
        out_type=out_type,
        scratch_types=scratch,
        grid=(tiles - split_from,), grid_names=("n",),
        **(dict(cluster=(split,), cluster_names=(cluster_sum.AXIS,)) if split > 1 else {}),
        interpret=interpret_params(interpret),
        kernel_name=f"decode_matmul_{w.format}" if quantized else "decode_matmul",
        # approximate exp and reciprocal (ex2.approx, rcp.approx) for SwiGLU's sigmoid: exact ones made
        # the prologue instruction-bound (one warpgroup per block converts every activation tile)
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             approx_math=swiglu),
    )
    out = call(*operands)
    return (out[0] if spill else out)[:m]


def decode_matmul_reference(x: jax.Array, w, residual: jax.Array | None = None, out_dtype=None, *,
                            norm_scale: jax.Array | None = None, norm_eps: float = 1e-6, swiglu: bool = False
                            ) -> jax.Array:
    """Plain jnp, rounded where the kernel rounds: the staged activations to bf16, f32 accumulation
    (times the channel scales of a quantized w, times 1 / rms with norm_scale), the product to
    out_dtype, then the residual's sum."""
    xf = x.astype(jnp.float32)
    row_scale = 1.0
    if swiglu:
        gate, up = jnp.split(xf, 2, axis=-1)
        xf = jax.nn.silu(gate) * up
    elif norm_scale is not None:
        row_scale = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)
        xf = xf * norm_scale.astype(jnp.float32)
    if isinstance(w, QuantizedWeight):   # per channel: the codes, then the channel scales
        codes = codes_as_bf16(natural_codes(w)).T
        y = jnp.dot(xf.astype(jnp.bfloat16), codes, preferred_element_type=jnp.float32) * w.scales[0].astype(jnp.float32)
    else:
        y = jnp.dot(xf.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    y = (y * row_scale).astype(out_dtype or x.dtype)
    return y if residual is None else (residual.astype(y.dtype) + y)

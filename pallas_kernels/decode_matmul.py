"""bf16 decode matmul: y = x @ W (+ residual) for the few rows of a decode step, W [K, N] as stored.

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
delays releasing their tiles). The residual tile is fetched while the weight streams; the product
is rounded to the output dtype and then added, as `residual + x @ w` rounds.

Where it runs (`pays`): bf16 weights on a GPU, at most `MAX_ROWS` rows, N of 64-96 tiles of 64
columns: what made whole steps faster on the H100 (Llama-3.1-8B's qkv, o_proj and down at bs=1
and bs=32). Measured and left to XLA (session 18):
- 64 rows (bs=64): the step took 7.97 ms against 6.94 with XLA's GEMM, although the kernel alone
  measured faster than XLA's GEMM at 64 rows (not profiled; with the residual tile, shared memory
  holds only two 256-row steps of a 64-row x);
- Llama-3.2-1B (32-48 tiles): the kernel alone ran its qkv and o_proj in under half XLA's time,
  but the multi-step bs=1 step was no faster (1.21 against 1.18 ms);
- wider weights (gate_up, the LM head) fill the GPU without a K split, and XLA's GEMM was 1-3%
  faster there; tensor-parallel partial sums were not measured with the kernel.
`ATLASJAX_DECODE_MATMUL=off` keeps XLA's GEMM everywhere (for A/B measurements).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm_tiling import SMEM_BUDGET, interpret_params, swizzled

TILE_N = 64       # weight columns per block: the M of one wgmma
MAX_ROWS = 32     # decode steps up to this many rows (docs/performance.md, session 18)
MIN_TILES, MAX_TILES = 64, 96   # the N tiles (of 64 columns) where it made steps faster


@dataclasses.dataclass(frozen=True)
class DecodeMatmulConfig:
    tile_k: int = 256             # K rows per pipeline step (a multiple of 64 that divides K)
    max_concurrent_steps: int = 4  # TMA steps in flight (capped by shared memory)
    wgmmas_in_flight: int = 0     # wgmmas left running across steps (< max_concurrent_steps)

    def __post_init__(self):
        if self.tile_k <= 0 or self.tile_k % 64:
            raise ValueError(f"tile_k must be a positive multiple of 64, got {self.tile_k}")
        if not 0 <= self.wgmmas_in_flight < self.max_concurrent_steps:
            raise ValueError("need 0 <= wgmmas_in_flight < max_concurrent_steps")


def default_config(n: int) -> DecodeMatmulConfig:
    """Per weight width, from the H100 sweep (notebooks/gpu_bf16_smem_gemv.py MODE=kernel, session
    18): 64 N tiles (o_proj, down) stream best in 256-row steps with one wgmma left in flight; more
    tiles (qkv's 96) in 128-row steps, waiting for each wgmma."""
    if n // TILE_N > 64:
        return DecodeMatmulConfig(tile_k=128, max_concurrent_steps=4, wgmmas_in_flight=0)
    return DecodeMatmulConfig(tile_k=256, max_concurrent_steps=4, wgmmas_in_flight=1)


def enabled() -> bool:
    return os.environ.get("ATLASJAX_DECODE_MATMUL", "").lower() not in ("off", "0", "false")


def pays(m: int, k: int, n: int, x_dtype, w_dtype) -> bool:
    """Whether y = x[m, k] @ w[k, n] should run this kernel on this (GPU) backend."""
    tiles = n // TILE_N
    config = default_config(n)
    return (enabled() and jnp.dtype(w_dtype) == jnp.bfloat16 and jnp.dtype(x_dtype) == jnp.bfloat16
            and 0 < m <= MAX_ROWS and n % TILE_N == 0 and k % config.tile_k == 0
            and MIN_TILES <= tiles <= MAX_TILES)


def decode_matmul_kernel(w_gmem, x_gmem, *refs, tile_k, depth, in_flight, with_residual):
    """One block: out[:, n tile] = x @ w[:, n tile] over all of K (+ residual[:, n tile]).

    Refs: w_gmem [K, N] bf16; x_gmem [m, K] bf16; (r_gmem [m, N] with_residual); out_gmem [m, N];
    scratch out_smem [m, TILE_N] (and r_smem [m, TILE_N] + a barrier with_residual).
    """
    if with_residual:
        r_gmem, out_gmem, out_smem, r_smem, r_barrier = refs
    else:
        out_gmem, out_smem = refs
    cols = pl.ds(lax.axis_index("n") * TILE_N, TILE_N)
    m = x_gmem.shape[0]
    if with_residual:   # in flight while the weight streams
        plgpu.copy_gmem_to_smem(r_gmem.at[:, cols], r_smem, r_barrier)
    w_spec = plgpu.BlockSpec((tile_k, TILE_N), lambda s: (s, 0), delay_release=in_flight,
                             transforms=swizzled(TILE_N * 16, 16, "weight"))
    x_spec = plgpu.BlockSpec((m, tile_k), lambda s: (0, s), delay_release=in_flight,
                             transforms=swizzled(tile_k * 16, 16, "x"))

    def body(acc_ref):
        def step(_, w_smem, x_smem):
            plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)
            plgpu.wgmma_wait(in_flight)

        plgpu.emit_pipeline(step, grid=(x_gmem.shape[1] // tile_k,), in_specs=[w_spec, x_spec],
                            max_concurrent_steps=depth)(w_gmem.at[:, cols], x_gmem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    acc = pl.run_scoped(body, plgpu.ACC((TILE_N, m), jnp.float32))
    # y [m, N] through a transposed view of the [m, TILE_N] scratch (no XLA transpose after it)
    y = plgpu.layout_cast(acc.astype(out_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    if with_residual:   # rounded as `residual + (x @ w)` is: the product first, then the sum
        plgpu.barrier_wait(r_barrier)
        r = plgpu.load(r_smem.T, layout=plgpu.Layout.WGMMA_TRANSPOSED)
        y = (r.astype(jnp.float32) + y.astype(jnp.float32)).astype(out_smem.dtype)
    out_smem.T[...] = y
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[:, cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def decode_matmul(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, *, out_dtype=None,
                  config: DecodeMatmulConfig | None = None, interpret=False) -> jax.Array:
    """y = x @ w with f32 accumulation (+ residual). x: [M, K] bf16 (M <= MAX_ROWS); w: [K, N] bf16,
    N a multiple of 64 and K of the config's tile_k; residual: None or [M, N], added to the product
    rounded to out_dtype, as `residual + x @ w` rounds. Returns [M, N] in out_dtype (default x.dtype).
    config None: `default_config(N)`."""
    m, k = x.shape
    n = w.shape[1]
    config = config or default_config(n)
    if w.shape[0] != k:
        raise ValueError(f"x has K={k} but the weight is {w.shape}")
    if n % TILE_N or k % config.tile_k or not 0 < m <= MAX_ROWS:
        raise ValueError(f"decode_matmul needs N % {TILE_N} == 0, K % {config.tile_k} == 0 and "
                         f"1 <= M <= {MAX_ROWS}; got M={m}, K={k}, N={n}")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"residual {residual.shape} is not the product's shape {(m, n)}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m_pad = -(-m // 8) * 8    # wgmma N: a multiple of 8
    pad = ((0, m_pad - m), (0, 0))
    per_step = (config.tile_k * TILE_N + m_pad * config.tile_k) * 2
    fixed = m_pad * TILE_N * out_dtype.itemsize * (1 if residual is None else 2)
    depth = max(1, min(config.max_concurrent_steps, k // config.tile_k, (SMEM_BUDGET - fixed) // per_step))
    in_flight = min(config.wgmmas_in_flight, depth - 1)
    operands = [w.astype(jnp.bfloat16), jnp.pad(x.astype(jnp.bfloat16), pad)]
    scratch = [plgpu.SMEM((m_pad, TILE_N), out_dtype)]
    if residual is not None:
        operands.append(jnp.pad(residual.astype(out_dtype), pad))
        scratch += [plgpu.SMEM((m_pad, TILE_N), out_dtype), plgpu.Barrier(num_arrivals=1)]
    call = plgpu.kernel(
        functools.partial(decode_matmul_kernel, tile_k=config.tile_k, depth=depth, in_flight=in_flight,
                          with_residual=residual is not None),
        out_type=jax.ShapeDtypeStruct((m_pad, n), out_dtype),
        scratch_types=scratch,
        grid=(n // TILE_N,), grid_names=("n",),
        interpret=interpret_params(interpret),
        kernel_name="decode_matmul",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return call(*operands)[:m]


def decode_matmul_reference(x: jax.Array, w: jax.Array, residual: jax.Array | None = None,
                            out_dtype=None) -> jax.Array:
    """Plain jnp: bf16 operands, f32 accumulation, the product rounded to out_dtype (+ residual)."""
    y = jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    y = y.astype(out_dtype or x.dtype)
    return y if residual is None else (residual.astype(y.dtype) + y)

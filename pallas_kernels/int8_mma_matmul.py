"""int8 weights times bf16 activations on the int8 tensor cores, without dequantizing the weight.

y[M, N] = x[M, K] @ W[K, N] for a per-channel int8 `QuantizedWeight` (W = q * s[n]).

The bf16 activation rows are split into two int8 parts with one scale per row,
    x[m, :] = r[m] * (hi[m, :] + lo[m, :] / LO_SCALE) + e,   r[m] = max|x[m, :]| / 127,
hi = round(x / r), lo = round((x / r - hi) * LO_SCALE), so |e| <= r / (2 LO_SCALE): the pair holds
~15 bits relative to the row's largest entry (bf16 holds 8 relative to each entry). Both parts go
through one s8 x s8 -> s32 wgmma per step as 2M columns of the B operand, against the weight tile
as the A operand straight from shared memory: no conversion of the weight anywhere, and the s32
accumulation is exact. The kernel stores the s32 sums; XLA applies r, 1 / LO_SCALE and the channel
scale in whatever consumes y (they are [M] and [N] vectors).

Kernel layout ("swap AB", as quantized_matmul.py): W is stored [N, K] (K contiguous); a block owns
TILE_N output channels and streams its [TILE_N, tile_k] weight tiles and the [R, tile_k] activation
tiles (R = 2M rounded up to 8) through a `plgpu.emit_pipeline`, keeping one wgmma in flight
(`delay_release=1`). K is split over a second grid axis when the N tiles alone cannot fill the GPU;
the s32 partials are summed by XLA.

Experimental: `quantized_matmul(..., backend="int8_mma")` runs it, "auto" does not. On the H100 at
the engine's 8 decode rows the kernel alone is within 1-4% of XLA's convert-fused int8 GEMM on
the Llama-3.1-8B layer shapes and 6% faster on the LM head (15-25% faster at 1 row), but the
activation split is an XLA fusion of its own (~3.6 us per GEMM), so the int8 step got slower
(3.76 vs 3.39 ms). docs/perf_quant.md, session 12.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm_tiling import SMEM_BUDGET, interpret_params, k_splits, swizzled
from pallas_kernels.quant_format import QuantizedWeight

TILE_N = 64  # weight rows per block: the M of one wgmma
LO_SCALE = 254.0  # (x / r - hi) is in [-0.5, 0.5]: times 254 it fills [-127, 127]
MAX_ROWS = 128  # 2 * rows must fit one wgmma N (<= 256)


@dataclasses.dataclass(frozen=True)
class Int8MmaConfig:
    tile_k: int = 256  # K elements per pipeline step (a multiple of 128: the 128-byte swizzle)
    max_concurrent_steps: int = 6  # TMA steps in flight
    num_k_splits: int | None = None  # None: enough splits to give every SM ~2 blocks

    def __post_init__(self):
        if self.tile_k % 128 or self.tile_k <= 0:
            raise ValueError(f"tile_k must be a positive multiple of 128, got {self.tile_k}")
        if self.max_concurrent_steps < 2:
            raise ValueError("max_concurrent_steps must be >= 2 (one wgmma stays in flight)")


def supports(qw: QuantizedWeight, rows: int) -> bool:
    """Whether this kernel computes x @ W for `rows` activation rows."""
    k_pad, n_pad = qw.padded_shape
    return (qw.format == "int8" and qw.num_groups == 1 and qw.zeros is None and rows <= MAX_ROWS
            and n_pad % TILE_N == 0 and k_pad % 128 == 0)


def split_activations(x: jax.Array, k_pad: int) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (parts [R, K_pad] int8: hi rows then lo rows, zero padded; r [M] f32)."""
    m, k = x.shape
    xf = x.astype(jnp.bfloat16).astype(jnp.float32)  # the bf16 activation is what is multiplied
    amax = jnp.max(jnp.abs(xf), axis=1)
    r = jnp.where(amax > 0, amax / 127.0, 1.0)
    u = xf / r[:, None]
    hi = jnp.round(u)
    lo = jnp.round((u - hi) * LO_SCALE)
    rows = -(-2 * m // 8) * 8
    parts = jnp.concatenate([hi, lo], axis=0).astype(jnp.int8)
    return jnp.pad(parts, ((0, rows - 2 * m), (0, k_pad - k))), r


def int8_mma_kernel(w_gmem, x_gmem, out_gmem, out_smem, *, tile_k, rows, steps_per_split, max_concurrent_steps):
    """One (N tile, K split) block: out[split, :, n_tile] = the s32 sums over its K steps."""
    n_idx, split = lax.axis_index("n"), lax.axis_index("split")
    n_slice = pl.ds(n_idx * TILE_N, TILE_N)
    first_step = split * steps_per_split
    transforms = swizzled(tile_k * 8, 8, "int8")  # both operands: int8 rows of tile_k, K contiguous
    in_specs = [plgpu.BlockSpec(shape, lambda k: (0, first_step + k), transforms=transforms, delay_release=1)
                for shape in ((TILE_N, tile_k), (rows, tile_k))]

    def body(acc_ref):
        def step(_, w_smem, x_smem):
            plgpu.wgmma(acc_ref, w_smem, x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(1)  # the previous step's wgmma is done: its tiles may be refilled

        plgpu.emit_pipeline(step, grid=(steps_per_split,), in_specs=in_specs,
                            max_concurrent_steps=max_concurrent_steps)(w_gmem.at[n_slice], x_gmem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    acc = pl.run_scoped(body, plgpu.ACC((TILE_N, rows), jnp.int32))
    out_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, :, n_slice])
    plgpu.wait_smem_to_gmem(0)


def _int8_mma_sums(parts, qw: QuantizedWeight, config: Int8MmaConfig, interpret) -> jax.Array:
    """parts [R, K_pad] int8 -> [R, N_pad] int32 = parts @ q.T."""
    k_pad, n_pad = qw.padded_shape
    rows = parts.shape[0]
    tile_k = config.tile_k
    while k_pad % tile_k:
        tile_k -= 128
    num_steps = k_pad // tile_k
    num_blocks = n_pad // TILE_N
    # auto: each split keeps >= 4 steps
    splits = k_splits(num_steps, num_blocks, requested=config.num_k_splits, max_auto=num_steps // 4)
    per_step = (TILE_N + rows) * tile_k
    depth = max(2, min(config.max_concurrent_steps, (SMEM_BUDGET - TILE_N * rows * 4) // per_step))
    kernel = functools.partial(int8_mma_kernel, tile_k=tile_k, rows=rows,
                               steps_per_split=num_steps // splits, max_concurrent_steps=depth)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, rows, n_pad), jnp.int32),
        scratch_types=[plgpu.SMEM((rows, TILE_N), jnp.int32)],
        grid=(num_blocks, splits),
        grid_names=("n", "split"),
        interpret=interpret_params(interpret),
        kernel_name="int8_mma_matmul",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    y = call(qw.qweight, parts)
    return y[0] if splits == 1 else y.sum(axis=0)


@functools.partial(jax.jit, static_argnames=("interpret", "out_dtype", "config"))
def int8_mma_matmul(x: jax.Array, qw: QuantizedWeight, *, out_dtype=None, interpret=False,
                    config: Int8MmaConfig = Int8MmaConfig()) -> jax.Array:
    """y = x @ W for a per-channel int8 W and up to MAX_ROWS rows of x ([M, K] -> [M, N])."""
    m, k = x.shape
    if k != qw.shape[0]:
        raise ValueError(f"x has K={k} but the weight is {qw.shape} (K, N)")
    if not supports(qw, m):
        raise ValueError(f"int8_mma_matmul takes per-channel int8 weights and <= {MAX_ROWS} rows, "
                         f"got {qw.format} with {qw.num_groups} groups and {m} rows")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    k_pad, _ = qw.padded_shape
    parts, r = split_activations(x, k_pad)
    sums = _int8_mma_sums(parts, qw, config, interpret).astype(jnp.float32)  # rounds at 2**-24 relative
    y = (sums[:m] + sums[m:2 * m] * (1.0 / LO_SCALE)) * r[:, None] * qw.scales[0].astype(jnp.float32)
    return y[:, :qw.shape[1]].astype(out_dtype)

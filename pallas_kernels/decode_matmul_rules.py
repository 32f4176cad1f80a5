"""The decode matmul's tunables, its per-shape defaults and where it runs.

pallas_kernels/decode_matmul.py is the kernel; this module holds what decides which config it runs
and whether a matmul takes it at all (`pays`, `prologue_pays`), from the H100 measurements in
docs/decode_matmul.md and docs/performance.md.

Where it runs (`pays`): bf16 and per-channel fp8 weights on an H100, at most `MAX_ROWS` rows, N of
64-96 column tiles (Llama-3.1-8B's qkv, o_proj and down), and per-channel int8 / fp8 weights of
`WIDE_MIN_TILES` tiles or more (the LM head); per-channel int8 at 64-96 tiles when forced
(`ATLASJAX_DECODE_MATMUL=on`). Grouped int4 runs its own kernel (pallas_kernels/quantized_matmul.py).
Which config (`default_config`): 2-block K splits for quantized weights of 64 tiles or fewer, 512-row
steps for the LM head, and a wait for each wgmma wherever the weight tile is converted in
registers (`REGISTER_A_IN_FLIGHT`). The measurements behind each rule, and the variants measured
and left opt-in, are in docs/decode_matmul.md.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.decode_switches import enabled, forced, prologues_on, wide_setting
from pallas_kernels.gemm_tiling import num_sms
from pallas_kernels.quant_format import QuantizedWeight

TILE_N = 64       # weight columns per block: the M of one wgmma
MAX_ROWS = 32     # decode steps up to this many rows (docs/performance.md, session 18)
MIN_TILES, MAX_TILES = 64, 96   # the N tiles (of 64 columns) where it made steps faster
NORM_MAX_TILE_K = 256   # the norm scale's TMA box: at most 256 elements
SWIGLU_MAX_ROWS = 8   # the SwiGLU prologue paid at 8 rows, and cost 10-80 us per call at 16-32 (session 19)


@dataclasses.dataclass(frozen=True)
class DecodeMatmulConfig:
    tile_k: int = 256             # K rows per pipeline step (a multiple of 64 that divides K)
    max_concurrent_steps: int = 4  # TMA steps in flight (capped by shared memory)
    wgmmas_in_flight: int = 0     # wgmmas left running across steps (< max_concurrent_steps)
    # int8 / fp8 weights: stage the bf16 tile in shared memory for the wgmma instead of feeding it
    # from registers (interpret mode always stages: its wgmma reads shared memory only)
    stage_weight: bool = False
    # 2: the blocks of a 2-block cluster each stream half of K for the same columns; the second hands
    # its f32 product to the first through distributed shared memory (pallas_kernels/cluster_sum.py).
    # Twice the blocks for the 64-tile weights, which otherwise run on 64 of the H100's 132 SMs.
    k_split: int = 1
    # With k_split 2 and sms > 0: only the tiles past the last full wave of `sms` blocks split (the
    # "tail"); the rest run whole, one per block, two blocks per cluster. For weights of a few waves
    # (gate_up: 448 tiles on 132 SMs) the last wave then takes half a tile's time instead of a whole.
    tail_split_sms: int = 0

    def __post_init__(self):
        if self.tile_k <= 0 or self.tile_k % 64:
            raise ValueError(f"tile_k must be a positive multiple of 64, got {self.tile_k}")
        if not 0 <= self.wgmmas_in_flight < self.max_concurrent_steps:
            raise ValueError("need 0 <= wgmmas_in_flight < max_concurrent_steps")
        if self.k_split not in (1, 2):
            raise ValueError(f"k_split must be 1 or 2, got {self.k_split}")
        if self.tail_split_sms < 0 or (self.tail_split_sms and self.k_split != 2):
            raise ValueError("tail_split_sms needs k_split 2 and a positive SM count")


def default_config(n: int, swiglu: bool = False, w_dtype=jnp.bfloat16, k: int | None = None) -> DecodeMatmulConfig:
    """Per weight width, from the H100 sweeps (notebooks/gpu_bf16_smem_gemv.py MODE=kernel, session
    18; MODE=prologue, session 19): 64 N tiles (o_proj, down) stream best in 256-row steps with one
    wgmma left in flight, but with the SwiGLU prologue waiting for each wgmma (39.99 against 40.85
    us on down); more tiles (qkv's 96) in 128-row steps, waiting for each wgmma. The prologue keeps
    the width's tile_k, so `pays` (which checks K against it) holds for it too. Quantized weights
    (notebooks/gpu_quant_decode_matmul.py, sessions 20-22): 256-row steps, and
    at 64 tiles or fewer a 2-block cluster per tile over the halves of K (`k_split`), where K (if
    given) halves into whole steps. Quantized tiles feed the wgmma from registers, so each step
    waits for its wgmma (`REGISTER_A_IN_FLIGHT`; sessions 22-29 left one in flight)."""
    if jnp.dtype(w_dtype).itemsize == 1:   # int8 / fp8
        tiles = n // TILE_N
        if tiles >= WIDE_MIN_TILES:
            return QUANT_WIDE_CONFIG
        if tiles > MAX_TILES and wide_setting() == "tail" and (k is None or k % (2 * QUANT_WIDE_CONFIG.tile_k) == 0):
            return dataclasses.replace(QUANT_WIDE_CONFIG, k_split=2, tail_split_sms=num_sms())
        split = tiles <= 64 and (k is None or k % (2 * QUANT_CONFIG.tile_k) == 0)
        return QUANT_SPLIT_CONFIG if split else QUANT_CONFIG
    if n // TILE_N > 64:
        return DecodeMatmulConfig(tile_k=128, max_concurrent_steps=4, wgmmas_in_flight=0)
    return DecodeMatmulConfig(tile_k=256, max_concurrent_steps=4, wgmmas_in_flight=0 if swiglu else 1)


# Quantized weights feed the wgmma from registers, so it waits for each wgmma (`REGISTER_A_IN_FLIGHT`).
QUANT_CONFIG = DecodeMatmulConfig(tile_k=256, max_concurrent_steps=4, wgmmas_in_flight=0)
# o_proj and down at 8 rows on the H100 (session 22): int8 9.07 / 23.31 us, fp8 8.65 / 22.90, against
# XLA's convert-fused GEMM at 8.55 / 24.45-25.00 and 12.0 / 35.2 (int8) without the split
QUANT_SPLIT_CONFIG = dataclasses.replace(QUANT_CONFIG, k_split=2)
# Many waves of tiles (the LM head: 2004), where a wave's tail costs little: 512-row steps. fp8 LM head
# at 8 rows on the H100 (session 23): 175.8 us, 98.6% of copy, against XLA's GEMM at 189.2 us
QUANT_WIDE_CONFIG = DecodeMatmulConfig(tile_k=512, max_concurrent_steps=4, wgmmas_in_flight=0)
WIDE_MIN_TILES = 1024
QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
# A wgmma whose A operand (the converted weight tile) is in registers may not be left running while
# the next step converts its tile: PTX leaves reading those registers before the wgmma's wait
# undefined, and on the H100 (session 30) such wgmmas read a later tile's values whenever the
# tensor cores were shared (two blocks per SM: grouped int4 gate_up and LM head products, when the
# kernel took int4, off by 4-25x in relative norm; int8 gate_up in session 21), while staged tiles
# or a wait per wgmma were right.
REGISTER_A_IN_FLIGHT = 0


def weight_dtype(w):
    """The dtype the kernel would stream `w` in, or None if it cannot take it: a bf16 array [K, N] or
    a per-channel int8 / fp8 `QuantizedWeight` stored without padding."""
    if isinstance(w, QuantizedWeight):
        per_channel = w.num_groups == 1 and w.zeros is None and jnp.dtype(w.qweight.dtype) in QUANT_DTYPES
        return w.qweight.dtype if per_channel and w.padded_shape == tuple(w.shape) else None
    return w.dtype if jnp.dtype(w.dtype) == jnp.bfloat16 else None


def prologue_pays(prologue: str, m: int, w_dtype=jnp.bfloat16, n: int | None = None, k: int | None = None) -> bool:
    """Whether a matmul that `pays` should also compute its activations ("rms_norm" or "swiglu") in
    the kernel for m rows. The RMSNorm prologue was faster than XLA's norm kernel + the kernel at 8-32
    rows; the SwiGLU prologue only at 8 (each thread converts 2 x rows x 2 activations per step of one
    warpgroup: at 16-32 rows that step outlasted the weight's), and only on bf16 weights: on int8
    down it cost 1.2-1.7 us more than XLA's silu * up kernel before the kernel, on fp8 it tied
    (session 22). `ATLASJAX_DECODE_PROLOGUE=off`: XLA computes both, for A/B measurements."""
    if not prologues_on():
        return False
    if prologue == "rms_norm" and n is not None:
        config = default_config(n, w_dtype=w_dtype, k=k)
        if config.k_split > 1 or config.tile_k > NORM_MAX_TILE_K:
            return False   # the norm needs all of K in one block, and its scale fits one TMA box
    swiglu = prologue == "swiglu" and m <= SWIGLU_MAX_ROWS and jnp.dtype(w_dtype) == jnp.bfloat16
    return prologue == "rms_norm" or swiglu


def pays(m: int, k: int, n: int, x_dtype, w_dtype) -> bool:
    """Whether y = x[m, k] @ w[k, n] should run this kernel on this (GPU) backend: bf16 and per-channel
    fp8 weights (`weight_dtype`), at decode rows, of 64-96 column tiles. Per-channel int8 only when
    forced (`ATLASJAX_DECODE_MATMUL=on`): the 8B bs=1 step was no faster with it (3.40 against 3.39
    ms, session 22; fp8 3.31 against 3.37). Per-channel int8 and fp8 also from WIDE_MIN_TILES tiles
    on (the LM head, `_takes_wide`)."""
    tiles = n // TILE_N
    config = default_config(n, w_dtype=w_dtype, k=k)
    narrow = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)) + ((jnp.dtype(jnp.int8),) if forced() else ())
    return (enabled() and jnp.dtype(x_dtype) == jnp.bfloat16
            and 0 < m <= MAX_ROWS and n % TILE_N == 0 and k % (config.k_split * config.tile_k) == 0
            and ((MIN_TILES <= tiles <= MAX_TILES and jnp.dtype(w_dtype) in narrow) or _takes_wide(tiles, w_dtype)))


def _takes_wide(tiles: int, w_dtype) -> bool:
    """int8 / fp8 weights of many waves of tiles (the LM head). fp8 at 8 rows on the H100 (session
    23): 176.0 against XLA's 188.9 us, and 3.30 against 3.32 ms per 8B bs=1 step."""
    wide = wide_setting()
    return jnp.dtype(w_dtype) in QUANT_DTYPES and wide != "off" and (tiles >= WIDE_MIN_TILES or wide in ("on", "tail"))

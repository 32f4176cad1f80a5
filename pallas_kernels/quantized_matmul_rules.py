"""The fused dequantize-matmul's tunables (`QuantMatmulConfig`) and the config each weight gets
(`default_config`), from the H100 measurements in docs/perf_quant.md and docs/performance.md.

pallas_kernels/quantized_matmul.py is the kernel; this module holds what decides how it runs (and
whether it can: `_can_use_pallas`), as decode_matmul_rules.py does for the decode matmul.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.gemm_tiling import elem_bits
from pallas_kernels.quant_format import QuantizedWeight, is_per_channel
from pallas_kernels.rows_matmul import max_8bit_rows

MAX_TILE_M = 256  # activation rows per tile: the largest wgmma N
TILE_N = 64  # weight rows per warpgroup: the M of one wgmma
DEFAULT_GROUP_UNROLL = 2  # groups per step on the per-group path (docs/perf_quant.md, session 7)


@dataclasses.dataclass(frozen=True)
class QuantMatmulConfig:
    """Tunables of the fused kernel. Checked against a weight in `_can_use_pallas`."""

    tile_k: int = 128  # K elements per pipeline step (capped at the group size)
    num_k_splits: int | None = None  # None: enough splits to give every SM work
    max_concurrent_steps: int = 4  # pipeline depth (TMA loads in flight per warpgroup)
    tile_m: int = 128  # activation rows per tile when M > DECODE_ROWS (multiple of 8, <= 256)
    # Grouped formats: fold each group's scale into the dequantized tile (rounded to bf16 per
    # weight, as dequantize-then-matmul does; `prescale_bf16`) and keep one accumulator over all K
    # steps; a step then spans several groups (up to prescale_tile_k elements). None: for groups
    # under 128 elements (GGUF Q8_0 / Q4_0 / Q4_1), where it measured 1.3-5x faster; groups of 128
    # stay one group per step with the scale on the f32 partial, faster there (docs/perf_quant.md,
    # session 4).
    prescale: bool | None = None
    prescale_tile_k: int = 256
    # Prescaled tiles in bf16 arithmetic (scales and offsets rounded to bf16, a multiply and an add
    # per weight on bf16 pairs) instead of f32 (a convert each way and f32 math on the whole tile).
    # H100, 8 rows, groups of 32 (session 33): int4 with offsets 4096x6144 15.0 -> 11.2 us, 14336x4096
    # 23.5 -> 17.8, 4096x128256 153 -> 121; int4 symmetric 4096x28672 38.9 -> 29.7; int8 17.5 -> 14.5
    # (4096x6144); relative error 2.4-2.9e-3 against 2.2-2.3e-3
    prescale_bf16: bool = True
    # Asymmetric groups: the offset term (x row sums times 8 s + zeros) inside the kernel, not in
    # XLA. Prescaled: added to the tile (H100, int4 g32 asym, 8 rows: 4096x28672 66.4 -> 47.8 us);
    # per group: a ones-tile wgmma (int4 g128 asym: 4096x28672 42.2 -> 38.4 us; docs/perf_quant.md).
    fold_zeros: bool = True
    # Float offsets on the per-group path: the offset term from x's sum over each group (an XLA
    # reduce next to the kernel, read per step) instead of one more wgmma per group, of a ones tile.
    x_sums: bool = False
    # Groups per pipeline step on the per-group path (groups of >= 128 elements, int4 by default):
    # all of a step's wgmmas are in flight before one wait. None: auto (`_unroll`).
    group_unroll: int | None = None

    def __post_init__(self):
        if self.tile_k % 16 or self.tile_k <= 0:
            raise ValueError(f"tile_k must be a positive multiple of 16, got {self.tile_k}")
        if self.tile_m % 8 or not 8 <= self.tile_m <= MAX_TILE_M:
            raise ValueError(f"tile_m must be a multiple of 8 in [8, 256], got {self.tile_m}")
        if self.max_concurrent_steps < 1:
            raise ValueError("max_concurrent_steps must be >= 1")
        if self.prescale_tile_k % 16 or self.prescale_tile_k <= 0:
            raise ValueError(f"prescale_tile_k must be a positive multiple of 16, got {self.prescale_tile_k}")
        if self.group_unroll is not None and self.group_unroll < 1:
            raise ValueError(f"group_unroll must be >= 1, got {self.group_unroll}")


def default_config(qw: QuantizedWeight, rows: int = 8) -> QuantMatmulConfig:
    """The fused kernel's tunables for a weight multiplied by `rows` activation rows (H100, 8 rows,
    sessions 33 and 35). Groups under 128:
    - int4 in mma order, up to 16 rows (decode), takes the per-group path with 8 groups of 32 per
      step (one 128-byte tile row) and 3 steps in flight: each group's f32 partial times its scale,
      exact up to the f32 sums (relative error 1.7e-3 against 2.4-2.9e-3 prescaled in bf16).
      Symmetric (GGUF Q4_0): 4096x6144 10.4 -> 9.0 us, 4096x28672 30.0 -> 29.5, 14336x4096
      16.4 -> 15.9, 4096x128256 108.7 -> 108.5. With float offsets (Q4_1, Q4_K), whose term comes
      from x's group sums (`x_sums`), only where the weight is narrow (K and N up to 6144): 4096x6144
      11.3 -> 9.9 us (11.5 -> 10.0 two-level); 4096x28672 32.4 -> 34.3 and 14336x4096 17.8 -> 19.5
      (two-level) got slower. More rows keep the prescaled path (8 accumulators per step would not
      fit in registers).
    - int4 with float offsets otherwise keeps 3 steps in flight: 4096x28672 41.3 -> 32.2 us, the
      other 8B shapes within 0.2 us but the 4096x128256 LM head shape, 119.2 -> 121.7;
    - int8 (GGUF Q8_0 and the types kept as int8) wider than 4096 columns steps over 512 rows, 2 in
      flight: 4096x6144 14.7 -> 13.7 us, 4096x28672 48.1 -> 46.5, the LM head shape 192.0 -> 190.1;
      not at 4096 columns (4096x4096 10.1 -> 13.2, 14336x4096 unchanged).
    - int4 with integer zero points in groups of 32 (`--quantization-group-size 32`), up to 16 rows,
      takes the per-group path too, each group's zero point in the conversion's subtract (H200, 8
      rows, session 48; us against the prescaled path): 4096x6144 9.3 / 11.7, 4096x28672 29.7 /
      32.4, 14336x4096 17.3 / 17.9, 4096x128256 102.6 / 111.6;
    - int4 groups of 64, with integer zero points or none, up to 16 rows: the per-group path with 4
      groups (one 128-byte tile row) per step (H200, session 48): zero points 8.0 / 11.2, 23.6 / 28.5,
      14.4 / 16.5, 81.8 / 98.8 us; symmetric 7.7 / 10.0, 21.3 / 23.9, 12.8 / 14.4, 74.1 / 81.1.
    The rest keep the defaults."""
    if qw.group_size >= 128 or qw.num_groups == 1:
        return QuantMatmulConfig()
    offsets = qw.format == "int4" and qw.zeros is not None and not qw.zero_point
    if qw.format == "int4" and qw.group_size == 32 and qw.mma_order and rows <= PER_GROUP_MAX_ROWS:
        if qw.zeros is None or qw.zero_point:
            return PER_GROUP_CONFIG
        if offsets and max(qw.shape) <= PER_GROUP_OFFSETS_MAX_WIDTH:
            return PER_GROUP_SUMS_CONFIG
    if (qw.format == "int4" and qw.group_size == 64 and qw.mma_order and rows <= PER_GROUP_MAX_ROWS
            and not offsets):
        return PER_GROUP_64_CONFIG
    if offsets:
        return OFFSETS_CONFIG
    return INT8_GROUPS_CONFIG if qw.format == "int8" and qw.shape[1] > 4096 else QuantMatmulConfig()


def fused_max_rows(qw: QuantizedWeight) -> int:
    """The most activation rows for which `quantized_matmul` (prefill="auto") runs the fused kernel,
    in M tiles of 128 rows past 128, on a weight that rows_matmul.py does not take (or not at this
    count); above, dequantizing the weight to bf16 for XLA's dot measured faster. The dequantize
    pass costs about the same at any row count (4096 x 28672: ~170 us), the fused kernel grows with
    its M tiles. H100, the 8B's gate_up and down (docs/perf_quant.md,
    session 37), fused against dequantized, us:
    - int4 groups of 128, integer zero points: 256 rows 137 / 80 against 262 / 129; 768 rows 406 /
      189 against 419 / 190 (qkv and o_proj 97 / 59 against 93 / 85); 1024 rows 534 / 248 against
      499 / 234;
    - Q4_1 (groups of 32, float offsets): 512 rows 268 / 140 against 337 / 155;
    - Q4_K (two levels): 384 rows 257 / 135 against 306 / 144; 512 rows 331 / 173 against 342 / 158;
    - FP8 with 128-wide block scales: 384 rows 264 / 127 against 298 / 141; 512 even;
    - Q8_0 (int8 groups of 32): 256 rows 272 / 89 against 271 / 134; 384 rows 424 / 120 against
      303 / 143.
    Per-channel int8 / fp8 never take this path (rows_matmul.py or XLA's convert-fused GEMM)."""
    if qw.format == "int4" and not qw.two_level:
        return 768 if qw.group_size >= 128 and (qw.zeros is None or qw.zero_point) else 512
    if qw.two_level or qw.format == "fp8":
        return 384
    return 256


OFFSETS_CONFIG = QuantMatmulConfig(max_concurrent_steps=3)
INT8_GROUPS_CONFIG = QuantMatmulConfig(prescale_tile_k=512, max_concurrent_steps=2)
PER_GROUP_CONFIG = QuantMatmulConfig(prescale=False, group_unroll=8, max_concurrent_steps=3)
PER_GROUP_SUMS_CONFIG = dataclasses.replace(PER_GROUP_CONFIG, x_sums=True)
PER_GROUP_64_CONFIG = QuantMatmulConfig(prescale=False, group_unroll=4)
PER_GROUP_MAX_ROWS = 16
PER_GROUP_OFFSETS_MAX_WIDTH = 6144


# ---- what the kernel can stream, and how (tiles, groups per step, where offsets are added)

def _tile_k(qw: QuantizedWeight, config: QuantMatmulConfig) -> int | None:
    """K elements per pipeline step, or None when the kernel cannot stream this weight.

    A weight tile row must span >= 32 bytes (the smallest swizzle): int4 with groups of 32 needs
    steps of several groups, which only the prescaled path has (an unswizzled variant lowered but
    computed garbage on the H100, 2026-11-21). Without prescaling a step stays inside one group.
    """
    k_pad, _ = qw.padded_shape
    g = qw.group_size
    if _prescales(qw, config):
        # the largest power-of-two multiple of the group size up to prescale_tile_k that divides K
        tiles = [g << i for i in range(8) if g << i <= max(config.prescale_tile_k, g)]
        tile = next((t for t in reversed(tiles) if k_pad % t == 0), g)
    else:
        tile = min(config.tile_k, g)
    # in mma order a step's groups load as one tile (`_unroll` of them), whose rows must span 32 bytes
    # (a multiple of them: the swizzle)
    wide = _unroll(qw, config, tile) if qw.mma_order else 1
    row_bits = tile * wide * elem_bits(qw.qweight.dtype)
    ok = k_pad % tile == 0 and row_bits >= 256 and (wide == 1 or row_bits % 256 == 0) and (g % tile == 0 or tile % g == 0)
    return tile if ok else None


def _prescales(qw: QuantizedWeight, config: QuantMatmulConfig) -> bool:
    if qw.num_groups == 1:   # per channel: the scale multiplies the final accumulator anyway
        return False
    return qw.group_size < 128 if config.prescale is None else config.prescale


def _folds_zeros(qw: QuantizedWeight, config: QuantMatmulConfig) -> bool:
    """Float offsets whose term the kernel computes (integer zero points need no term)."""
    return config.fold_zeros and qw.zeros is not None and not qw.zero_point and qw.num_groups > 1


def _xla_offsets(qw: QuantizedWeight, config: QuantMatmulConfig) -> bool:
    """Float offsets whose term XLA adds next to the kernel (`fold_zeros=False`)."""
    return qw.zeros is not None and not qw.zero_point and not _folds_zeros(qw, config)


def _unroll(qw: QuantizedWeight, config: QuantMatmulConfig, tile_k: int) -> int:
    """Groups per pipeline step on the per-group path: 1 unless a tile is exactly one group."""
    if _prescales(qw, config) or qw.num_groups == 1 or tile_k != qw.group_size:
        return 1
    want = DEFAULT_GROUP_UNROLL if config.group_unroll is None else config.group_unroll
    unroll = max(1, min(want, qw.num_groups))
    while qw.num_groups % unroll:
        unroll -= 1
    return unroll


def _can_use_pallas(qw: QuantizedWeight, config: QuantMatmulConfig) -> bool:
    k_pad, n_pad = qw.padded_shape
    tile_k = _tile_k(qw, config)
    ok = n_pad % TILE_N == 0 and tile_k is not None and qw.scales.shape == (k_pad // qw.group_size, n_pad)
    if ok and qw.two_level:   # steps within a super-group or over whole ones
        sg = qw.super_group
        step_k = tile_k if _prescales(qw, config) else tile_k * _unroll(qw, config, tile_k)
        ok = ((step_k % sg == 0 or sg % step_k == 0) and (_prescales(qw, config) or tile_k == qw.group_size)
              and qw.super_scales.shape == (k_pad // sg, n_pad) and not qw.zero_point)
    return ok


CONVERT_FUSED_MAX_ROWS = 2048          # up to this many rows per-channel weights of up to
CONVERT_FUSED_MAX_ELEMS = 4096 * 4096   # this many elements keep the convert-fused GEMM (`convert_fused_pays`)


def convert_fused_pays(qw: QuantizedWeight, m: int) -> bool:
    """Whether XLA's convert-fused GEMM (`quantized_matmul.xla_convert_matmul`) runs this per-channel
    weight at m rows, not `quantized_matmul.dequantized_dot`. H200, the 8B's projections, XLA's GEMMs
    (docs/perf_quant.md, session 84): at 2,048 rows the dequantized copy ran qkv, gate_up and down
    1-10% faster (gate_up fp8 725 against 791 us), o_proj (4096x4096) 23% slower (133 against 108
    us: cuBLAS's choice for that shape with both minor dims contracted); at 4,096 rows the copy was
    1-11% faster on all but o_proj (226 against 216 us), at 8,192 rows 12-15% faster on all but down
    (a tie; o_proj fp8 368 against 425 us). Up to 1,024 rows, where the decode matmul or rows kernel
    does not run, nothing changed (`rows_matmul.max_8bit_rows`: weights of 16,384 or more columns, and
    int8 weights 12,288 or more deep, take the copy from 1,024 rows; sessions 86-88). Re-measured with
    the copy written as uint32 words (session 85): o_proj at 2,048 rows still 108 us convert-fused against
    127 via the copy."""
    if not is_per_channel(qw):
        return False
    k_pad, n_pad = qw.padded_shape
    return m <= max_8bit_rows(qw) or (m <= CONVERT_FUSED_MAX_ROWS and k_pad * n_pad <= CONVERT_FUSED_MAX_ELEMS)

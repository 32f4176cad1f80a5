"""int4 -> bf16 for a weight tile stored in mma order (`quant_format.to_mma_order`), in registers.

The tile [64, tile_k] is loaded from shared memory in Mosaic's `WGMMA_UPCAST_4X` layout: thread t
of a row's quad gets stored positions 8t .. 8t + 7 of each 32-column block as one 32-bit word
(one shared-memory load per eight weights). In mma order those are exactly the columns the thread
holds in wgmma's A-fragment layout (`WGMMA`), so no data moves between threads: each word becomes
four bf16 pairs, pair q taking nibbles q and q + 4,

    pair_q = ((word >> 4q) & 0x000F000F) ^ 0x43084308    (bf16 pair 128 + (n ^ 8) = 136 + n)
    out_q  = pair_q - bias                                (bf16x2 subtract, exact)

a shift, a lop3 and a subtract per two weights. With bias = 136 + z the subtract also removes the
group's integer zero point (n - z is a whole number in [-15, 15], exact in bf16); with 136 it
leaves n. Mosaic's own int4 conversion of the natural layout reads one byte per two weights and
subtracts the zero point separately (docs/perf_quant.md, session 13).

`inline_mgpu` has no interpret mode: there `mma_tile_to_bf16` undoes the order with jnp instead,
which computes the same values.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental import mosaic
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quant_format import from_mma_order

ZERO_BIAS = 136.0  # the bias of the lop3 trick: a pair holds 136 + n


def _pair_asm(shift: int, with_bias: bool) -> str:
    """PTX: $0 = (($1 >> shift) & 0x000F000F ^ 0x43084308) - bias, bias = $2 or 136 in both halves."""
    shr = f"shr.u32 s, $1, {shift};" if shift else "mov.b32 s, $1;"
    bias = "$2" if with_bias else "b"
    return (f"{{ .reg .b32 s, b; {shr} lop3.b32 s, s, 0x000F000F, 0x43084308, 0x6a; "
            f"{'' if with_bias else 'mov.b32 b, 0x43084308; '}sub.bf16x2 $0, s, {bias}; }}")


def _pair_words(rows_fa, i16, i32):
    """A [64] bf16 row in WGMMA.reduce(1) (two values a thread: rows r and r + 8 of its warp's 16) as
    two 32-bit words holding the value in both halves."""
    assert rows_fa.registers.size == 2, rows_fa.registers.shape
    halves = [arith.extui(i32, mosaic.gpu.utils.bitcast(r, i16)) for r in rows_fa.registers.flat]
    return [arith.ori(h, arith.shli(h, arith.constant(i32, 16))) for h in halves]


def _convert(rows: int, tile_k: int, parts: int, part: int, with_bias: bool):
    """The inline conversion of columns [part * tile_k / parts, (part + 1) * tile_k / parts) of a
    [rows, tile_k] tile (one K group of several side by side; the others' registers go unused)."""
    mgpu = mosaic.gpu
    part_k = tile_k // parts
    arg_types = (plgpu.Layout.WGMMA_UPCAST_4X,) + ((plgpu.Layout.WGMMA.reduce(1),) if with_bias else ())

    @plgpu.inline_mgpu(arg_types=arg_types,
                       return_type=plgpu.ShapeDtypeStruct((rows, part_k), jnp.bfloat16, plgpu.Layout.WGMMA))
    def convert(_, w, *bias):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        pair_ty = ir.VectorType.get((2,), ir.BF16Type.get())
        if with_bias:
            bias_words = _pair_words(bias[0], i16, i32)
        out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((rows, part_k)), dtype=object)
        blocks_per_part = part_k // 32
        # w registers [.., T, .., row half, ..]: the word of 32-column block T; the WGMMA registers
        # [.., c8, .., row half, ..]: the pair of 8-column slice c8 = 4T + q (T counted in the part).
        for idx, reg in np.ndenumerate(w.registers):
            if idx[-8] // blocks_per_part != part:
                continue
            word = mgpu.utils.bitcast(reg, i32)
            block, half = idx[-8] % blocks_per_part, idx[-5]
            for q in range(4):
                if with_bias:
                    pair = llvm.inline_asm(i32, [word, bias_words[half]], _pair_asm(4 * q, True), "=r,r,r")
                else:
                    pair = llvm.inline_asm(i32, [word], _pair_asm(4 * q, False), "=r,r")
                out[(*idx[:-8], 4 * block + q, *idx[-7:])] = mgpu.utils.bitcast(pair, pair_ty)
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return convert


def mma_tile_to_bf16(w, zero_row=None, *, parts: int = 1, part: int = 0, interpret: bool):
    """w: [rows, tile_k] int4 tile value in mma order holding `parts` K groups side by side;
    zero_row: [rows] f32 integer zero points of group `part`, or None. Returns that group's bf16
    tile [rows, tile_k / parts] in natural column order, q - z (or q), in the WGMMA layout."""
    rows, tile_k = w.shape
    part_k = tile_k // parts
    if interpret:
        a = from_mma_order(w.astype(jnp.bfloat16))[:, part * part_k:(part + 1) * part_k]
        if zero_row is None:
            return a
        return a - jnp.broadcast_to(zero_row.astype(jnp.bfloat16)[:, None], a.shape)
    if zero_row is None:
        return _convert(rows, tile_k, parts, part, False)(w)
    return _convert(rows, tile_k, parts, part, True)(w, (zero_row + ZERO_BIAS).astype(jnp.bfloat16))

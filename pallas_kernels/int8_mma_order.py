"""int8 -> bf16 for a weight tile stored in int8 mma order (`quant_format.to_mma_order`), in registers.

The tile [64, tile_k] is loaded from shared memory in Mosaic's `WGMMA_UPCAST_4X` layout: thread t
of a row's quad gets stored positions 8t .. 8t + 7 of each 32-column block as one 64-bit load (two
32-bit words h = 0, 1). In int8 mma order those are exactly the columns the thread holds in wgmma's
A-fragment layout (`WGMMA`), and the pair of 8-column slice q = 2h + l sits at bytes l and l + 2 of
word h, each in the low byte of a 16-bit half once word h is shifted right by 8 l. A signed byte
x = lo7 - 128 * bit7 then becomes bf16 exactly as

    lo  = (s & 0x007F007F) | 0x43004300    (bf16 pair 128 + lo7)
    hi  = (s & 0x00800080) | 0x43004300    (bf16 pair 128 + 128 * bit7: 128 or 256)
    out = lo - hi                          (bf16x2 subtract, exact: an integer in [-128, 127])

two lop3, a subtract and (for l = 1) a shift per two weights, with no data moved between threads.
Mosaic's own int8 -> bf16 conversion of a natural-order tile does the same with a prmt more per
pair, from one 16-bit shared-memory load per pair (its PTX; docs/performance.md, session 21).

`inline_mgpu` has no interpret mode: there `mma_tile_to_bf16` undoes the order with jnp instead,
which computes the same values.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm, vector
from jax.experimental import mosaic
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quant_format import codes_as_bf16, from_mma_order


def _pair_asm(shift: int) -> str:
    """PTX: $0 = bf16x2 of the signed bytes 0 and 2 of ($1 >> shift)."""
    src = "$1"
    pre = ""
    if shift:
        pre, src = f"shr.b32 s, $1, {shift}; ", "s"
    return (f"{{ .reg .b32 s, lo, hi; {pre}"
            f"lop3.b32 lo, {src}, 0x007F007F, 0x43004300, 0xea; "
            f"lop3.b32 hi, {src}, 0x00800080, 0x43004300, 0xea; "
            f"sub.bf16x2 $0, lo, hi; }}")


def _convert(rows: int, tile_k: int):
    mgpu = mosaic.gpu

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct((rows, tile_k), jnp.bfloat16, plgpu.Layout.WGMMA))
    def convert(_, w):
        i32 = ir.IntegerType.get_signless(32)
        pair_ty = ir.VectorType.get((2,), ir.BF16Type.get())
        words_ty = ir.VectorType.get((2,), i32)
        out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((rows, tile_k)), dtype=object)
        # w registers [.., T, .., row half, ..]: the 8 bytes of 32-column block T; the WGMMA
        # registers [.., c8, .., row half, ..]: the pair of 8-column slice c8 = 4T + q
        for idx, reg in np.ndenumerate(w.registers):
            words = vector.bitcast(words_ty, reg)
            for h in range(2):
                word = vector.extract(words, [], [h])
                for lane_byte in range(2):
                    pair = llvm.inline_asm(i32, [word], _pair_asm(8 * lane_byte), "=r,r")
                    q = 2 * h + lane_byte
                    out[(*idx[:-8], 4 * idx[-8] + q, *idx[-7:])] = mgpu.utils.bitcast(pair, pair_ty)
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return convert


def mma_tile_to_bf16(w, *, interpret: bool):
    """w: [rows, tile_k] int8 tile value in int8 mma order. Returns it as bf16 in natural column
    order, in the WGMMA layout (interpret mode: undone with jnp)."""
    if interpret:
        return codes_as_bf16(from_mma_order(w, "int8"))
    return _convert(*w.shape)(w)

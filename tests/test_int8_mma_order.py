"""Per-channel int8 weights in mma order (session 21, opt-in: `with_mma_order`): the permutation,
the register mapping and bit trick the decode kernel's conversion relies on, and that every path
(the decode kernel, quantized_matmul's backends, slicing for tensor parallelism) keeps the
weight's meaning.

The in-kernel conversion (`inline_mgpu`) has no interpret mode, so CI checks its register mapping
against Mosaic GPU's own layout definitions and its arithmetic in numpy; the `gpu` tests in
test_decode_matmul.py (fmt "int8mma") run it.
"""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import fragmented_array as fa

from atlasjax.quantization import concat_quantized, dequantize, quantize, slice_quantized
from pallas_kernels.quant_format import MMA_BLOCK, from_mma_order, to_mma_order, with_mma_order
from pallas_kernels.quantized_matmul import quantized_matmul
from tests.test_int4_mma_order import _elements


def _weight(k, n, seed=0):
    return np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)


def test_permutation_puts_each_threads_pairs_in_its_words():
    natural = np.arange(2 * MMA_BLOCK)[None, :]
    stored = to_mma_order(natural, "int8")
    np.testing.assert_array_equal(from_mma_order(stored, "int8"), natural)
    for block, t, h, b, l in itertools.product(range(2), range(4), range(2), range(2), range(2)):
        # stored position 8t + 4h + 2b + l of a block holds its logical column 16h + 8l + 2t + b
        assert stored[0, block * 32 + 8 * t + 4 * h + 2 * b + l] == block * 32 + 16 * h + 8 * l + 2 * t + b
    assert not np.array_equal(stored, to_mma_order(natural, "int4"))   # each format has its own order


def test_kernel_register_mapping_matches_mosaic_layouts():
    # What pallas_kernels/int8_mma_order.py assumes: byte e = 4h + 2b + l of a thread's UPCAST_4X
    # register of 32-column block T (row half r) is element b of its WGMMA register (slice
    # 4T + 2h + l, row half r), once the stored order is undone.
    rows, tile_k = 64, 128
    loaded = _elements(fa.WGMMA_LAYOUT_UPCAST_4X, (rows, tile_k))
    wgmma = _elements(fa.WGMMA_LAYOUT, (rows, tile_k))
    logical_of_stored = to_mma_order(np.arange(tile_k)[None, :], "int8")[0]   # stored pos -> logical col
    for (warp, lane, reg, e), (row, stored_col) in loaded.items():
        h, b, lane_byte = e // 4, (e // 2) % 2, e % 2
        out_reg = list(reg)
        out_reg[-8] = 4 * reg[-8] + 2 * h + lane_byte
        assert wgmma[(warp, lane, tuple(out_reg), b)] == (row, logical_of_stored[stored_col])
    assert len(loaded) == rows * tile_k


def _bf16(bits):
    return np.frombuffer(np.asarray(bits, np.uint32).astype(np.uint32) << 16, np.float32)


def test_conversion_arithmetic_is_exact_for_every_byte():
    # The PTX of int8_mma_order._pair_asm, per 16-bit half: lo = (s & 0x7F) | 0x4300,
    # hi = (s & 0x80) | 0x4300, x = bf16(lo) - bf16(hi).
    s = np.arange(256, dtype=np.uint32)
    x = _bf16((s & 0x7F) | 0x4300) - _bf16((s & 0x80) | 0x4300)
    np.testing.assert_array_equal(x, s.astype(np.uint8).view(np.int8).astype(np.float32))


@pytest.mark.parametrize("k,n", [(256, 128), (300, 70)])
@pytest.mark.parametrize("backend", ["reference", "xla", "pallas", "int8_mma"])
def test_quantized_matmul_backends_compute_the_same(k, n, backend):
    # Paths other than the decode kernel permute x's K instead (K not a multiple of 32: padded)
    w = _weight(k, n, seed=k)
    natural = quantize(w, "int8")
    ordered = with_mma_order(natural)
    assert ordered.mma_order and not natural.mma_order
    np.testing.assert_array_equal(np.asarray(dequantize(ordered)), np.asarray(dequantize(natural)))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((17, k)), jnp.float32)
    interpret = {"interpret": True} if backend in ("pallas", "int8_mma") else {}
    want = np.asarray(quantized_matmul(x, natural, backend=backend, **interpret))
    got = np.asarray(quantized_matmul(x, ordered, backend=backend, **interpret))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_slice_and_concat_along_k_keep_the_meaning():
    # Row-parallel splits: at a 32-aligned cut the pieces stay in mma order; elsewhere they are
    # cut in natural order and re-ordered where their K allows.
    w = _weight(256, 40, seed=3)
    qw = with_mma_order(quantize(w, "int8"))
    whole = np.asarray(dequantize(qw))
    for cut in (128, 48):
        parts = [slice_quantized(qw, 0, 0, cut), slice_quantized(qw, 0, cut, 256 - cut)]
        np.testing.assert_array_equal(np.asarray(dequantize(parts[0])), whole[:cut])
        np.testing.assert_array_equal(np.asarray(dequantize(parts[1])), whole[cut:])
        np.testing.assert_array_equal(np.asarray(dequantize(concat_quantized(parts, 0))), whole)
    assert all(p.mma_order for p in (slice_quantized(qw, 0, 0, 128), slice_quantized(qw, 0, 128, 128)))

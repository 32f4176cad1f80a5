"""int4 weights in mma order: the permutation, the register mapping it relies on, and that every
structural operation (slice, concat, save) keeps the weight's meaning.

The in-kernel conversion (`inline_mgpu`) has no interpret mode, so CI checks its register
mapping here against Mosaic GPU's own layout definitions, and the `gpu` tests in
test_quantized_matmul.py run it.
"""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import fragmented_array as fa

from atlasjax.gguf_blocks import from_gguf_blocks
from atlasjax.quantization import concat_quantized, dequantize, quantize, slice_quantized
from pallas_kernels.quant_format import MMA_BLOCK, from_mma_order, to_mma_order, with_mma_order


def _weight(k, n, seed=0):
    return np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)


def test_permutation_puts_each_threads_columns_in_one_word():
    natural = np.arange(2 * MMA_BLOCK)[None, :]
    stored = to_mma_order(natural)
    np.testing.assert_array_equal(from_mma_order(stored), natural)
    for block, t, b, q in itertools.product(range(2), range(4), range(2), range(4)):
        # stored position 8t + 4b + q of a block holds its logical column 8q + 2t + b
        assert stored[0, block * 32 + 8 * t + 4 * b + q] == block * 32 + 8 * q + 2 * t + b


def _elements(layout, shape):
    """{(warp, lane, register index, vector element): (row, col)} of a Mosaic GPU TiledLayout."""
    tiled = layout.tiling.tile_shape(shape)
    lane_sizes = [tiled[d] for d in layout.lane_dims]
    out = {}
    for idx in np.ndindex(*tiled):
        warp = idx[layout.warp_dims[0]]
        lane = idx[layout.lane_dims[0]] * lane_sizes[1] + idx[layout.lane_dims[1]]
        reg = list(idx)
        for d in (layout.warp_dims[0], *layout.lane_dims, layout.vector_dim):
            reg[d] = 0
        out[(warp, lane, tuple(reg), idx[layout.vector_dim])] = layout.tiling.untile_indices(idx)
    return out


def test_kernel_register_mapping_matches_mosaic_layouts():
    # What pallas_kernels/int4_mma_order.py assumes: a thread's UPCAST_4X word of 32-column block
    # T (row half h) holds, at nibbles q and q + 4, the two columns of its WGMMA register
    # (slice 4T + q, row half h), once the stored order is undone.
    rows, tile_k = 64, 128
    loaded = _elements(fa.WGMMA_LAYOUT_UPCAST_4X, (rows, tile_k))
    wgmma = _elements(fa.WGMMA_LAYOUT, (rows, tile_k))
    logical_of_stored = from_mma_order(np.arange(tile_k)[None, :])[0].argsort()  # stored pos -> logical col
    checked = 0
    for (warp, lane, reg, e), (row, stored_col) in loaded.items():
        q, b = e % 4, e // 4
        out_reg = list(reg)
        out_reg[-8] = 4 * reg[-8] + q
        assert wgmma[(warp, lane, tuple(out_reg), b)] == (row, logical_of_stored[stored_col])
        checked += 1
    assert checked == rows * tile_k


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_stores_int4_in_mma_order_with_the_same_meaning(symmetric):
    w = _weight(300, 70)
    qw = quantize(w, "int4", symmetric=symmetric)
    natural = with_mma_order(qw, False)
    assert qw.mma_order and not natural.mma_order
    assert not np.array_equal(np.asarray(qw.qweight, np.int8), np.asarray(natural.qweight, np.int8))
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), np.asarray(dequantize(natural)))
    assert not quantize(w, "int8").mma_order   # only int4 is permuted


def test_gguf_q4_blocks_load_in_mma_order():
    from gguf import GGMLQuantizationType, quants
    w = _weight(64, 96).T   # HF [N, K]
    raw = quants.quantize(w, GGMLQuantizationType.Q4_0)
    qw = from_gguf_blocks(raw, GGMLQuantizationType.Q4_0, w.shape)
    assert qw.mma_order
    np.testing.assert_array_equal(np.asarray(dequantize(qw)),
                                  quants.dequantize(raw, GGMLQuantizationType.Q4_0).T.astype(np.float32))


@pytest.mark.parametrize("group_size", [16, 128])
def test_slice_and_concat_along_k_keep_the_meaning(group_size):
    # Tensor-parallel row splits cut K at group boundaries, which need not be 32-aligned (groups
    # of 16); the pieces and their join must dequantize to the matching rows of the whole.
    k = 4 * group_size + (48 if group_size == 16 else 0)
    w = _weight(k, 40, seed=group_size)
    qw = quantize(w, "int4", group_size=group_size)
    whole = np.asarray(dequantize(qw))
    cut = group_size if group_size == 16 else 2 * group_size
    parts = [slice_quantized(qw, 0, 0, cut), slice_quantized(qw, 0, cut, k - cut)]
    assert all(p.mma_order for p in parts)
    np.testing.assert_array_equal(np.asarray(dequantize(parts[0])), whole[:cut])
    np.testing.assert_array_equal(np.asarray(dequantize(parts[1])), whole[cut:])
    joined = concat_quantized(parts, 0)
    assert joined.mma_order and joined.shape == (k, 40)
    np.testing.assert_array_equal(np.asarray(dequantize(joined)), whole)
    cols = concat_quantized([slice_quantized(qw, 1, 0, 16), slice_quantized(qw, 1, 16, 24)], 1)
    np.testing.assert_array_equal(np.asarray(dequantize(cols)), whole)


def test_natural_order_weights_still_compute_the_same():
    # Checkpoints saved before mma order load with mma_order False; the kernel keeps that path.
    from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference
    w = _weight(256, 64, seed=5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, 256)), jnp.bfloat16)
    for qw in (quantize(w, "int4"), with_mma_order(quantize(w, "int4"), False)):
        y = quantized_matmul(x, qw, backend="pallas", interpret=True, out_dtype=jnp.float32)
        ref = np.asarray(quantized_matmul_reference(x, qw))
        assert np.linalg.norm(np.asarray(y) - ref) / np.linalg.norm(ref) < 4e-3

"""Quantization formats: error bounds, packing round trips, GGUF blocks, param-tree walking."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.gguf_blocks import from_gguf_blocks
from atlasjax.quantization import (QuantizedWeight, concat_quantized, dequantize, quantize, quantize_params,
                                   slice_quantized)


def _weight(k, n, seed=0):
    return np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("fmt,bound", [("int8", 0.012), ("fp8", 0.04)])
@pytest.mark.parametrize("k,n", [(64, 32), (300, 130)])
def test_int8_fp8_relative_error(fmt, bound, k, n):
    w = _weight(k, n)
    qw = quantize(w, fmt)
    assert qw.shape == (k, n) and qw.scales.shape[0] == 1
    assert _rel(dequantize(qw), w) < bound


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_within_group_bounds(group_size, symmetric):
    k, n = 256 + group_size, 96
    w = _weight(k, n, seed=group_size)
    qw = quantize(w, "int4", group_size=group_size, symmetric=symmetric)
    assert (qw.zeros is None) == symmetric and qw.zero_point == (not symmetric) and qw.group_size == group_size
    if not symmetric:   # integer zero points in [-8, 7]
        z = np.asarray(qw.zeros)
        assert np.array_equal(z, np.round(z)) and z.min() >= -8 and z.max() <= 7
    deq = np.asarray(dequantize(qw))
    # Every element is within half a quantization step of its group, plus what the bf16 rounding
    # of the step (2^-11 relative) can add at the group's extremes (at most 15 of them).
    step = np.repeat(np.asarray(qw.scales, np.float32), group_size, axis=0)[:k, :n]
    assert np.all(np.abs(deq - w) <= (0.5 + 16 * 2 ** -11) * step + 1e-7)


def test_int4_asymmetric_fits_skewed_groups():
    # Mostly positive groups: a symmetric grid wastes most of its negative levels; the asymmetric
    # one spans [min(w, 0), max(w, 0)] with 0 exact.
    w = np.abs(_weight(256, 64)) * 0.1 - 0.02
    sym, asym = quantize(w, "int4", symmetric=True), quantize(w, "int4")
    assert asym.zero_point and sym.zeros is None   # int4 defaults to asymmetric, as the engine loads it
    assert _rel(dequantize(asym), w) < 0.6 * _rel(dequantize(sym), w)
    assert np.all(np.asarray(dequantize(quantize(np.zeros((256, 64), np.float32), "int4"))) == 0)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_quantize_dequantize_is_idempotent(fmt):
    # Dequantized values lie on the grid: quantizing them again gives the same codes and scales.
    qw = quantize(_weight(130, 70), fmt)
    again = quantize(np.asarray(dequantize(qw)), fmt)
    np.testing.assert_array_equal(np.asarray(again.qweight).astype(np.float32),
                                  np.asarray(qw.qweight).astype(np.float32))
    np.testing.assert_allclose(np.asarray(again.scales), np.asarray(qw.scales), rtol=1e-6)


def test_padding_and_pytree():
    qw = quantize(_weight(100, 50), "int4", group_size=32, symmetric=True)
    assert qw.qweight.shape == (128, 256) and qw.qweight.dtype == jnp.int4
    assert qw.scales.shape == (8, 128)
    assert np.all(np.asarray(dequantize(qw, jnp.float32)).shape == (100, 50))
    leaves, treedef = jax.tree.flatten(qw)
    assert len(leaves) == 2  # zeros=None is no leaf; format/group_size/shape/zero_point are static
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert (rebuilt.format, rebuilt.group_size, rebuilt.shape) == ("int4", 32, (100, 50))
    asym = quantize(_weight(100, 50), "int4", group_size=32)
    leaves, treedef = jax.tree.flatten(asym)
    assert len(leaves) == 3 and jax.tree.unflatten(treedef, leaves).zero_point


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0,
                                   gguf.GGMLQuantizationType.Q4_1])
@pytest.mark.parametrize("n,k", [(96, 160), (33, 64)])
def test_from_gguf_blocks_is_exact(qtype, n, k):
    w_hf = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w_hf, qtype)  # [N, bytes_per_row] uint8, as GGUFReader gives
    expected = gguf.quants.dequantize(raw, qtype).T  # [K, N]
    qw = from_gguf_blocks(raw, qtype, (n, k))
    assert qw.shape == (k, n) and qw.group_size == 32
    assert qw.format == ("int8" if qtype.name == "Q8_0" else "int4")
    assert (qw.zeros is not None) == (qtype.name == "Q4_1") and not qw.zero_point   # Q4_1: float offsets
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), expected)
    np.testing.assert_array_equal(np.asarray(dequantize(from_gguf_blocks(raw.reshape(-1), int(qtype), (n, k)))),
                                  expected)


def test_quantize_params_selects_projection_kernels():
    params = {
        "embed_tokens": {"embedding": _weight(64, 32)},
        "layers_0": {
            "self_attn": {"q_proj": {"kernel": _weight(32, 64), "bias": np.zeros(64, np.float32)},
                          "o_proj": {"kernel": _weight(64, 32)}},
            "mlp": {"down_proj": {"kernel": _weight(128, 32)}},
            "input_layernorm": {"scale": np.ones(32, np.float32)},
        },
        "lm_head": {"kernel": _weight(32, 64)},
    }
    out = quantize_params(params, "int8")
    assert isinstance(out["layers_0"]["self_attn"]["q_proj"]["kernel"], QuantizedWeight)
    assert isinstance(out["layers_0"]["mlp"]["down_proj"]["kernel"], QuantizedWeight)
    assert out["layers_0"]["self_attn"]["q_proj"]["bias"] is params["layers_0"]["self_attn"]["q_proj"]["bias"]
    assert out["lm_head"]["kernel"] is params["lm_head"]["kernel"]
    assert out["embed_tokens"]["embedding"] is params["embed_tokens"]["embedding"]
    only_q = quantize_params(params, "int4", include=lambda path, leaf: "q_proj" in path and path[-1] == "kernel")
    assert isinstance(only_q["layers_0"]["self_attn"]["q_proj"]["kernel"], QuantizedWeight)
    assert not isinstance(only_q["layers_0"]["self_attn"]["o_proj"]["kernel"], QuantizedWeight)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown format"):
        quantize(_weight(32, 32), "int3")
    with pytest.raises(ValueError, match="asymmetric"):
        quantize(_weight(32, 32), "int8", symmetric=False)
    with pytest.raises(ValueError, match="not supported"):
        from_gguf_blocks(np.zeros((1, 10), np.uint8), "Q5_K", (1, 32))


@pytest.mark.parametrize("fmt,kw", [("int8", {}), ("int4", dict(group_size=32, symmetric=False))])
@pytest.mark.parametrize("dim", [0, 1])
def test_concat_quantized_undoes_slice_quantized(fmt, kw, dim):
    """Tensor-parallel placement slices weights; saving and fused projections join them again."""
    w = np.random.RandomState(0).randn(192, 160).astype(np.float32)
    qw = quantize(w, fmt, **kw)
    cut = 64 if dim == 0 else 96
    parts = [slice_quantized(qw, dim, 0, cut), slice_quantized(qw, dim, cut, w.shape[dim] - cut)]
    assert all(p.zero_point == qw.zero_point for p in parts)
    joined = concat_quantized(parts, dim)
    assert joined.shape == qw.shape and joined.group_size == qw.group_size and joined.zero_point == qw.zero_point
    np.testing.assert_array_equal(np.asarray(dequantize(joined)), np.asarray(dequantize(qw)))

"""Fused q/k/v and gate/up projections (models/fused.py): same outputs as the per-projection layout,
an exact round trip back to it (what `LLM.save` writes), on one device and sharded over a mesh."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.config import ModelConfig
from atlasjax.loader import random_params
from atlasjax.quantization import quantize_params
from atlasjax.sharding import TP_AXIS, TensorParallel, make_mesh
from models.attention import AttentionMetadata
from models.fused import fuse_projections, unfuse_projections
from models.layers import is_quantized
from models.transformer import Transformer, init_kv_cache

# head_dim 16: k/v are 32 wide (N padded to 64 when quantized), q 64, so padding sits between the parts
LLAMA = ModelConfig(family="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=512)
QWEN2 = dataclasses.replace(LLAMA, family="qwen2", qkv_bias=True)
QWEN3 = dataclasses.replace(LLAMA, family="qwen3", qk_norm=True, num_kv_heads=1)
WIDTHS = {"qkv_proj": (64, 32, 32), "gate_up_proj": (96, 96)}


def _forward(cfg, params, n=7):
    model = Transformer(cfg, attn_backend="reference", dtype=jnp.float32)
    kv = init_kv_cache(cfg, 1, 16, jnp.float32)
    meta = AttentionMetadata(slot_mapping=jnp.arange(n), page_table=jnp.zeros((1, 1), jnp.int32),
                             seq_lens=jnp.array([n]), query_start=jnp.array([0, n]), num_seqs=jnp.array(1))
    tokens = jnp.arange(n) * 31 % cfg.vocab_size
    hidden, _ = model.apply({"params": params}, tokens, jnp.arange(n), kv, meta)
    return np.asarray(model.apply({"params": params}, hidden, method=Transformer.logits))


def _assert_trees_equal(a, b):
    la, ta = jax.tree.flatten(a, is_leaf=is_quantized)
    lb, tb = jax.tree.flatten(b, is_leaf=is_quantized)
    assert ta == tb
    for x, y in zip(la, lb):
        if is_quantized(x):
            assert (x.format, x.group_size, x.shape, x.qweight.shape) == (y.format, y.group_size, y.shape, y.qweight.shape)
            n = x.shape[1]   # what the padding holds is not part of the weight
            for f, n_axis in (("qweight", -2), ("scales", -1), ("zeros", -1)):
                xs, ys = getattr(x, f), getattr(y, f)
                assert (xs is None) == (ys is None)
                if xs is not None:
                    xs, ys = (np.asarray(jax.lax.slice_in_dim(a, 0, n, axis=a.ndim + n_axis).astype(jnp.float32))
                              for a in (xs, ys))
                    np.testing.assert_array_equal(xs, ys)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("cfg", [LLAMA, QWEN2, QWEN3], ids=["llama", "qwen2_bias", "qwen3_qknorm"])
def test_fused_model_computes_what_the_separate_projections_do(cfg):
    params = random_params(cfg, jnp.float32, seed=1)
    fused = fuse_projections(params)
    layer = fused["layers_0"]
    assert set(layer["self_attn"]) >= {"qkv_proj", "o_proj"} and "q_proj" not in layer["self_attn"]
    assert set(layer["mlp"]) == {"gate_up_proj", "down_proj"}
    if cfg.qkv_bias:
        assert layer["self_attn"]["qkv_proj"]["bias"].shape == (64 + 2 * 16 * cfg.num_kv_heads,)
    np.testing.assert_allclose(_forward(cfg, fused), _forward(cfg, params), rtol=1e-5, atol=1e-5)
    assert "q_proj" in params["layers_0"]["self_attn"], "the given tree must be left as it was"


@pytest.mark.parametrize("fmt,kw", [("int8", {}), ("int4", dict(group_size=32, symmetric=False))])
def test_quantized_parts_fuse_along_n_without_their_padding(fmt, kw):
    params = quantize_params(random_params(LLAMA, jnp.float32, seed=2), fmt, **kw)
    fused = fuse_projections(params)
    qkv = fused["layers_1"]["self_attn"]["qkv_proj"]["kernel"]
    assert is_quantized(qkv) and qkv.shape == (64, 128) and qkv.qweight.shape[0] == 128   # 64 + 32 + 32, no gaps
    np.testing.assert_allclose(_forward(LLAMA, fused), _forward(LLAMA, params), rtol=1e-5, atol=1e-5)
    _assert_trees_equal(unfuse_projections(fused, WIDTHS), params)


def test_round_trip_restores_the_checkpoint_layout():
    params = random_params(QWEN2, jnp.bfloat16, seed=3)
    _assert_trees_equal(unfuse_projections(fuse_projections(params), WIDTHS), params)


def test_in_place_fusion_releases_the_separate_arrays():
    params = random_params(LLAMA, jnp.float32, seed=4)
    q = params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    want = _forward(LLAMA, params)
    fused = fuse_projections(params, in_place=True)
    assert fused is params and "q_proj" not in params["layers_0"]["self_attn"]
    np.testing.assert_allclose(_forward(LLAMA, fused), want, rtol=1e-5, atol=1e-5)
    assert q.shape == (64, 64)   # a reference the caller kept stays valid


def test_mixed_kinds_stay_separate():
    """A GGUF file may store v_proj in another block type than q/k: that group is left unfused."""
    params = random_params(LLAMA, jnp.float32, seed=5)
    mixed = quantize_params(params, "int8", include=lambda path, leaf: "v_proj" in path and "kernel" in path)
    fused = fuse_projections(mixed)
    assert {"q_proj", "k_proj", "v_proj"} <= set(fused["layers_0"]["self_attn"])
    assert "gate_up_proj" in fused["layers_0"]["mlp"]
    np.testing.assert_allclose(_forward(LLAMA, fused), _forward(LLAMA, mixed), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_sharded_fusion_keeps_each_devices_parts_and_round_trips(quant):
    tp = 2
    plan = TensorParallel(make_mesh(tp), LLAMA)
    params = random_params(LLAMA, jnp.float32, seed=6, plan=plan)
    if quant:   # quantized per device, stacked on a leading device axis (as the loader places them)
        from atlasjax.loader import LoadedModel
        from atlasjax.model_source import shard_loaded
        loaded = LoadedModel(LLAMA, quantize_params(random_params(LLAMA, jnp.float32, seed=6), quant), None, "t")
        params = shard_loaded(loaded, tp, jnp.float32).params
    fused = fuse_projections(params, plan.mesh, TP_AXIS)
    qkv = fused["layers_0"]["self_attn"]["qkv_proj"]["kernel"]
    leaf = qkv.qweight if quant else qkv
    assert leaf.sharding.spec[0 if quant else 1] == TP_AXIS
    # device d holds [q_d | k_d | v_d]: its q columns are the d-th half of q_proj's
    local = np.asarray(leaf.addressable_shards[1].data)
    q = params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    if quant:
        np.testing.assert_array_equal(local[0, :32], np.asarray(q.qweight.addressable_shards[1].data)[0, :32])
    else:
        np.testing.assert_array_equal(local[:, :32], np.asarray(q)[:, 32:])
    _assert_trees_equal(unfuse_projections(fused, WIDTHS, plan.mesh, TP_AXIS), params)

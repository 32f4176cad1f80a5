"""Decoder layers as calls of one jitted function (models/transformer.py): a step program lowers one
layer, not every layer, and computes what the inline layers compute."""
import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench.presets import PRESETS
from atlasjax.loader import random_params
from models.attention import AttentionMetadata
from models.transformer import Transformer, init_kv_cache


def _decode_step(cfg, params):
    model = Transformer(cfg, attn_backend="reference", dtype=jnp.float32)
    kv = init_kv_cache(cfg, 4, 16, jnp.float32)
    meta = AttentionMetadata(slot_mapping=jnp.array([0, 16]), page_table=jnp.array([[0, 1], [2, 3]], jnp.int32),
                             seq_lens=jnp.array([1, 1]))

    def step(tokens, positions, kv):
        hidden, kv = model.apply({"params": params}, tokens, positions, kv, meta)
        return model.apply({"params": params}, hidden, method=Transformer.logits), kv
    return jax.jit(step), (jnp.array([7, 42]), jnp.array([0, 0]), kv)


def test_a_step_lowers_one_layer_and_matches_inline_layers(monkeypatch):
    cfg = PRESETS["tiny"]
    params = random_params(cfg, jnp.float32, seed=3)
    step, args = _decode_step(cfg, params)
    text = step.lower(*args).as_text()
    assert text.count("func.func private @call_layer") == 1          # traced and lowered once
    assert text.count("call @call_layer") == cfg.num_layers          # called by every layer
    logits, kv = step(*args)
    monkeypatch.setenv("ATLASJAX_LAYER_CALLS", "off")
    inline_step, args = _decode_step(cfg, params)
    assert "@call_layer" not in inline_step.lower(*args).as_text()
    inline_logits, inline_kv = inline_step(*args)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(inline_logits), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(kv), jax.tree.leaves(inline_kv)):   # the K/V written to the pages too
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

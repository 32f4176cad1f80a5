"""The model's attention path through the Pallas kernels, run in Mosaic GPU interpret mode on CPU
(`attn_backend="interpret"`): a tiny bf16 Llama's prefill (ragged kernel) and decode step (the decode
kernel writing the new token's K/V itself) against the same model on the jnp references.

Not covered here: the kernels per shard under tensor parallelism. jax 0.11.2's Mosaic GPU
interpreter fails inside shard_map over several CPU devices ("Barrier remains allocated": its
shared-memory bookkeeping), so TP with the kernels is checked on 2x H200 (docs/tensor_parallel.md)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.config import ModelConfig
from atlasjax.loader import random_params
from models.attention import AttentionMetadata
from models.transformer import Transformer, init_kv_cache

# head_dim 64 and bf16 pools: shapes the kernels take (the CI-sized models elsewhere use head_dim 16).
CFG = ModelConfig(family="llama", vocab_size=256, hidden_size=128, intermediate_size=192, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=512)
# head_dim 128, 4 query heads per KV head: decode steps hand the raw projections to the kernel,
# which applies RoPE itself (pallas_kernels/rope.py; the engine fuses qkv, which that path needs).
CFG_ROPE = dataclasses.replace(CFG, head_dim=128, num_heads=16, num_kv_heads=4)
PAGE, PAGES = 16, 6


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _prefill_then_decode(backend, params, prompt):
    """Prefill the prompt into slot 0 (pages 0..2), then one decode step with slot 1 inactive.

    Each pass is one jitted call, waited on before the host touches its outputs: run op by op, an
    interpreted kernel's callbacks dispatch jax ops of their own while the main thread dispatches
    the next op, and on a 2-core machine the two deadlocked in jax's interpreter (seen once in CI)."""
    model = Transformer(CFG, attn_backend=backend, dtype=jnp.bfloat16)

    @jax.jit
    def forward(tokens, positions, kv, meta):
        hidden, kv = model.apply({"params": params}, tokens, positions, kv, meta)
        return model.apply({"params": params}, hidden, method=Transformer.logits), kv

    kv = init_kv_cache(CFG, PAGES, PAGE, jnp.bfloat16)
    n = len(prompt)
    table = jnp.array([[0, 1, 2], [3, 4, 5]], jnp.int32)
    meta = AttentionMetadata(slot_mapping=jnp.arange(n), page_table=table, seq_lens=jnp.array([n, 0]),
                             query_start=jnp.array([0, n, n]), num_seqs=jnp.array(2))
    prefill_logits, kv = jax.block_until_ready(forward(jnp.array(prompt), jnp.arange(n), kv, meta))
    token = int(np.argmax(np.asarray(prefill_logits)[-1]))
    meta = AttentionMetadata(slot_mapping=jnp.array([n, PAGES * PAGE]), page_table=table,
                             seq_lens=jnp.array([n + 1, 0]))
    decode_logits, kv = jax.block_until_ready(forward(jnp.array([token, 0]), jnp.array([n, 0]), kv, meta))
    return prefill_logits, decode_logits[0], kv


def test_model_through_the_kernels_matches_the_references():
    params = random_params(CFG, jnp.bfloat16, seed=3)
    prompt = list(np.random.default_rng(0).integers(0, CFG.vocab_size, 21))
    ref_prefill, ref_decode, ref_kv = _prefill_then_decode("reference", params, prompt)
    out_prefill, out_decode, out_kv = _prefill_then_decode("interpret", params, prompt)
    assert _rel(out_prefill, ref_prefill) < 2e-2
    assert _rel(out_decode, ref_decode) < 2e-2
    n = len(prompt)
    for (k, v), (rk, rv) in zip(out_kv, ref_kv):
        # every prompt slot and the decode token's slot (position n: page 1, row 5) hold K/V; the
        # inactive slot 1's pages and the rest of the pool stay zero
        written = np.zeros((PAGES * PAGE,), bool)
        written[: n + 1] = True
        for pool, ref in ((k, rk), (v, rv)):
            flat = np.asarray(pool, np.float32).reshape(CFG.num_kv_heads, -1, CFG.head_dim)
            assert np.all(flat[:, ~written] == 0)
            assert np.all(np.abs(flat[:, written]).sum(-1) > 0)
            assert _rel(flat, np.asarray(ref, np.float32).reshape(flat.shape)) < 2e-2
    # layer 0's K/V come from the embeddings alone: written bit for bit alike by both paths
    np.testing.assert_array_equal(np.asarray(out_kv[0][0], np.float32), np.asarray(ref_kv[0][0], np.float32))
    np.testing.assert_array_equal(np.asarray(out_kv[0][1], np.float32), np.asarray(ref_kv[0][1], np.float32))


def _engine_run(backend, cfg=CFG):
    """Two requests of different lengths, 6 greedy tokens each: (tokens, logprobs) per request;
    asserts every page comes back."""
    from atlasjax.bench.presets import synthetic_tokenizer
    from atlasjax.engine import LLMEngine
    from atlasjax.engine_config import EngineConfig
    from atlasjax.loader import LoadedModel
    from atlasjax.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(dtype="bfloat16", attention_backend=backend, max_num_seqs=2, max_model_len=64,
                                    page_size=PAGE, num_pages=9, max_num_batched_tokens=32),
                       LoadedModel(cfg, random_params(cfg, jnp.bfloat16, 3), tokenizer=synthetic_tokenizer(cfg),
                                   source="test"))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    engine.add_request("a", list(range(3, 24)), sp)
    engine.add_request("b", list(range(40, 47)), sp)
    tokens, logprobs = {"a": [], "b": []}, {"a": [], "b": []}
    while engine.has_unfinished():
        for d in engine.step():
            tokens[d.request_id] += d.new_token_ids
            logprobs[d.request_id] += [next(iter(x.values())).logprob for x in d.new_logprobs or []]
    assert engine.pool.num_free_pages == engine.pool.num_pages
    return tokens, logprobs


@pytest.mark.parametrize("cfg", [CFG, CFG_ROPE], ids=["head_dim_64", "head_dim_128_rope_in_kernel"])
def test_engine_through_the_kernels_matches_the_references(cfg):
    """The runner's compiled, donated steps with `attention_backend="interpret"` decode the same
    greedy tokens (logprobs within bf16 kernel rounding) as on the references."""
    (ref_tokens, ref_lp), (tokens, lp) = _engine_run("reference", cfg), _engine_run("interpret", cfg)
    assert tokens == ref_tokens and all(len(t) == 6 for t in tokens.values())
    for r in ("a", "b"):
        np.testing.assert_allclose(lp[r], ref_lp[r], atol=5e-3)

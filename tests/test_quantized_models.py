"""Quantized models: KL divergence to the unquantized model, and the Paris check on 4-bit and int8.

The reference is the embedded SmolLM2 with its GGUF weights dequantized to float32. Bounds are
measured on this model (docs/quantization.md): int8 and fp8 are near-lossless; int4 (group 128,
re-quantizing already 4-bit weights) is documented, not near-lossless.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from models.attention import AttentionMetadata
from models.transformer import Transformer, init_kv_cache

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "In 1969, astronauts first",
           "Water boils at a temperature of"]
KL_BOUNDS = {"int8": 0.01, "fp8": 0.035, "int4": 0.55, "gguf-q4_1": 0.0}   # mean nats per token


def _full_logprobs(engine, ids):
    """log-softmax over the vocabulary at every prompt position, one sequence, no cache reuse."""
    cfg, ps = engine.model_config, 16
    n = len(ids)
    num_pages = -(-n // ps)
    model = Transformer(cfg, attn_backend="reference", dtype=jnp.float32)
    kv = init_kv_cache(cfg, num_pages, ps, jnp.float32)
    meta = AttentionMetadata(slot_mapping=jnp.arange(n), page_table=jnp.arange(num_pages)[None],
                             seq_lens=jnp.array([n]), query_start=jnp.array([0, n]), num_seqs=jnp.array(1))
    params = {"params": engine.runner.checkpoint_params()}
    hidden, _ = model.apply(params, jnp.array(ids), jnp.arange(n), kv, meta)
    return np.asarray(jax.nn.log_softmax(model.apply(params, hidden, method=Transformer.logits), axis=-1))


@pytest.fixture(scope="module")
def reference(default_model_path):
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=256, keep_gguf_quantized=False)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    return ids, [_full_logprobs(llm.engine, i) for i in ids]


@pytest.mark.parametrize("mode", ["gguf-q4_1", "int8", "fp8", "int4"])
def test_mean_kl_to_the_unquantized_model(default_model_path, reference, mode):
    kwargs = dict(keep_gguf_quantized=True) if mode == "gguf-q4_1" else dict(quantization=mode)
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=256, **kwargs)
    ids, ref = reference
    kls = []
    for i, r in zip(ids, ref):
        q = _full_logprobs(llm.engine, i)
        kls.append(np.sum(np.exp(r) * (r - q), axis=-1).mean())
    kl = float(np.mean(kls))
    print(f"{mode}: mean KL {kl:.5f} nats/token")
    assert kl <= KL_BOUNDS[mode] + 1e-4, f"{mode} KL {kl}"


@pytest.mark.parametrize("kwargs", [dict(keep_gguf_quantized=True), dict(quantization="int8")], ids=["own-4bit", "int8"])
def test_quantized_default_still_answers_paris(default_model_path, kwargs):
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=256, **kwargs)
    leaf = llm.engine.runner.params["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert hasattr(leaf, "qweight"), "projections must stay quantized on device"
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text

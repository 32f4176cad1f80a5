"""`LLM.update_params`: new weights (shaped as `LLM.params`) replace the engine's between requests, as an RL
or fine-tuning loop in a notebook needs. The engine must then answer as an engine built on those weights,
without compiling again and without serving prompt pages cached under the old weights; a gradient step
taken through `LLM.model_fn` must lower the loss the engine then scores; a mismatched tree must be
refused with the leaf named, the old weights still serving."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.errors import InvalidRequestError
from tests.hf_models import make_hf_model

KW = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)
PROMPT = list(range(5, 45))      # 40 tokens: two whole pages the prefix cache keeps


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two engines on the same architecture with different random weights."""
    dirs = [str(tmp_path_factory.mktemp(f"weights{seed}")) for seed in (0, 1)]
    for seed, d in enumerate(dirs):
        make_hf_model("llama_gqa4", d, seed=seed)
    return [LLM(d, **KW) for d in dirs]


def _greedy(llm, n=8):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n))[0]


def test_the_engine_answers_as_one_built_on_the_new_weights(models):
    first, second = models
    before = _greedy(first)
    assert first.engine.pool.cached                                     # the prompt's pages are cached
    compiles = first.engine.runner.num_compiles
    old = first.params
    first.update_params(second.params)
    after = _greedy(first)
    assert after.outputs[0].token_ids == _greedy(second).outputs[0].token_ids != before.outputs[0].token_ids
    assert after.num_cached_tokens == 0                                 # no K/V of the old weights reused
    np.testing.assert_allclose(first.forward([PROMPT])[0], second.forward([PROMPT])[0], rtol=1e-5, atol=1e-5)
    assert first.engine.runner.num_compiles == compiles                 # the same programs
    first.update_params(old)
    assert _greedy(first).outputs[0].token_ids == before.outputs[0].token_ids


def test_a_gradient_step_lowers_the_loss_the_engine_then_scores(models):
    llm = models[0]
    tokens = jnp.asarray([PROMPT])
    fn = llm.model_fn(reference=True)

    def loss(params):
        logits = fn(params, tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    def engine_loss():
        logits = llm.forward([PROMPT])[0][:-1].astype(np.float64)
        logprobs = logits - logits.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        return -logprobs[np.arange(len(PROMPT) - 1), PROMPT[1:]].mean()
    params = llm.params
    grads = jax.grad(loss)(params)
    stepped = jax.tree.map(lambda p, g: p - 0.5 * g if jnp.issubdtype(p.dtype, jnp.floating) else p, params, grads)
    before = engine_loss()
    llm.update_params(stepped)
    assert engine_loss() < before - 1e-3
    llm.update_params(params)
    assert engine_loss() == pytest.approx(before, rel=1e-6)


def test_a_mismatched_tree_is_refused_and_the_old_weights_serve_on(models):
    llm = models[0]
    want = _greedy(llm, 4).outputs[0].token_ids
    params = llm.params
    embedding = params["embed_tokens"]["embedding"]
    halved = {**params, "embed_tokens": {"embedding": embedding.astype(jnp.float16)}}
    with pytest.raises(InvalidRequestError, match=r"params\['embed_tokens'\]\['embedding'\]: float16"):
        llm.update_params(halved)
    with pytest.raises(InvalidRequestError, match="tree differs"):
        llm.update_params({k: v for k, v in params.items() if k != "embed_tokens"})
    assert _greedy(llm, 4).outputs[0].token_ids == want
    llm.engine.add_request("busy", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="in flight"):
        llm.update_params(params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.release("busy")

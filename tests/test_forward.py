"""LLM.forward / LLM.model_fn: whole sequences in one pass, against transformers and the engine's own
scoring, gradients against torch autograd, and bad input refused without touching the engine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from atlasjax import LLM, InvalidRequestError, SamplingParams
from tests.hf_models import hf_logprobs

LENS = (5, 23, 40)   # a 16-token pad, a page boundary crossed, the longest sets the batch's length


def _prompts(seed=0, lens=LENS):
    rs = np.random.RandomState(seed)
    return [[int(t) for t in rs.randint(0, 512, size=n)] for n in lens]


def _log_softmax(logits):
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module", params=["qwen2", "llama_tied_mha"])
def case(request, hf_model_factory):
    hf, path = hf_model_factory(request.param)
    return hf, LLM(path, max_num_seqs=4, max_model_len=160, page_size=16, max_num_batched_tokens=64)


def test_forward_matches_hf_logprobs(case):
    hf, llm = case
    prompts = _prompts()
    outs = llm.forward(prompts)
    for prompt, logits in zip(prompts, outs):
        assert logits.shape == (len(prompt), 512) and logits.dtype == np.float32
        np.testing.assert_allclose(_log_softmax(logits), hf_logprobs(hf, prompt), atol=1e-4)


def test_forward_agrees_with_the_engines_prompt_logprobs_and_greedy_token(case):
    _, llm = case
    prompt = _prompts(seed=1, lens=(37,))[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    lp = _log_softmax(llm.forward(prompt)[0])
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - lp[i - 1, prompt[i]]) < 1e-4, i
    assert out.outputs[0].token_ids[0] == int(np.argmax(lp[-1]))


def test_a_batch_reads_as_each_sequence_alone(case):
    _, llm = case
    prompts = _prompts(seed=2)
    batched = llm.forward(prompts)
    for prompt, logits in zip(prompts, batched):
        np.testing.assert_allclose(logits, llm.forward(prompt)[0], atol=1e-5)


def test_hidden_states_give_the_logits(case):
    _, llm = case
    (logits, hidden), = llm.forward([_prompts(seed=3, lens=(9,))[0]], return_hidden=True)
    assert hidden.shape == (9, 64)
    head = llm.params["embed_tokens"]["embedding"].T if "lm_head" not in llm.params else llm.params["lm_head"]["kernel"]
    np.testing.assert_allclose(hidden @ np.asarray(head), logits, atol=1e-4)


def test_gradients_match_torch_autograd(case):
    """jax.grad through model_fn: the mean next-token loss's gradient on the final norm, an o_proj and a
    down_proj equals torch's on the same weights."""
    hf, llm = case
    tokens = np.asarray(_prompts(seed=4, lens=(24, 24)), np.int32)
    fn = llm.model_fn(reference=True)

    def loss(params):
        lp = jax.nn.log_softmax(fn(params, tokens)[:, :-1])
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1).mean()
    grads = jax.jit(jax.grad(loss))(llm.params)

    hf.zero_grad()
    logits = hf(torch.tensor(tokens, dtype=torch.long)).logits[:, :-1]
    torch.nn.functional.cross_entropy(logits.reshape(-1, 512), torch.tensor(tokens[:, 1:]).reshape(-1).long()).backward()
    layer = hf.model.layers[1]
    pairs = [(grads["norm"]["scale"], hf.model.norm.weight.grad),
             (grads["layers_1"]["self_attn"]["o_proj"]["kernel"], layer.self_attn.o_proj.weight.grad.T),
             (grads["layers_1"]["mlp"]["down_proj"]["kernel"], layer.mlp.down_proj.weight.grad.T)]
    for got, want in pairs:
        want = want.numpy()
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5 + 1e-3 * np.abs(want).max())


def test_bad_sequences_are_refused_and_the_engine_serves_on(case):
    _, llm = case
    engine = llm.engine
    for bad in ([[]], [[1, 2, 512]], [[-1]], [[1] * 161]):
        with pytest.raises(InvalidRequestError):
            llm.forward(bad)
    with pytest.raises(InvalidRequestError):
        llm.forward([])
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_forward_under_tensor_parallelism_equals_one_device(hf_model_factory):
    _, path = hf_model_factory("qwen2_tp")
    kwargs = dict(max_num_seqs=2, max_model_len=64, page_size=16, max_num_batched_tokens=32)
    prompts = [[int(t) for t in np.random.RandomState(5).randint(0, 500, size=n)] for n in (7, 30)]
    one = LLM(path, **kwargs).forward(prompts)
    two = LLM(path, tensor_parallel_size=2, **kwargs).forward(prompts)
    for a, b in zip(one, two):
        assert b.shape == a.shape
        np.testing.assert_allclose(b, a, atol=1e-4)


def test_forward_on_int8_weights_scores_as_the_engine_does(hf_model_factory):
    """Quantized weights (their own pytrees in `LLM.params`) go through the same matmul entry."""
    _, path = hf_model_factory("qwen2")
    llm = LLM(path, quantization="int8", max_num_seqs=2, max_model_len=64, page_size=16, max_num_batched_tokens=64)
    prompt = _prompts(seed=6, lens=(30,))[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    lp = _log_softmax(llm.forward(prompt)[0])
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - lp[i - 1, prompt[i]]) < 1e-4, i


def test_reference_traces_the_jnp_paths_where_the_engine_would_run_kernels():
    """On a GPU the engine's Pallas kernels have no VJP: `reference=True` must trace around them. A model
    on the kernels (`attn_backend="interpret"`, head_dim 64 in bf16, shapes they take) traces the kernel
    by default and, with the switch, the very program of a model on the jnp references, which has a
    gradient (tracing only)."""
    import types

    from atlasjax.config import ModelConfig
    from atlasjax.forward import model_fn
    from atlasjax.loader import random_params
    from models.transformer import Transformer

    cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=128, intermediate_size=192, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=512)
    params = random_params(cfg, jnp.bfloat16, seed=1)
    tokens = jnp.zeros((2, 32), jnp.int32)

    def runner(backend):
        return types.SimpleNamespace(model=Transformer(cfg, attn_backend=backend, dtype=jnp.bfloat16), cfg=cfg,
                                     page_size=16, kv_dtype=jnp.dtype(jnp.bfloat16), plan=None)

    def program(fn):
        return str(jax.make_jaxpr(fn)(params, tokens))
    on_kernels, on_references = program(model_fn(runner("interpret"))), program(model_fn(runner("reference")))
    assert "mpmd_map" in on_kernels and "mpmd_map" not in on_references   # the interpreted Mosaic GPU kernel
    fn = model_fn(runner("interpret"), reference=True)
    assert program(fn) == on_references
    grad = jax.eval_shape(jax.grad(lambda p: fn(p, tokens).sum()), params)
    assert jax.tree.structure(grad) == jax.tree.structure(params)

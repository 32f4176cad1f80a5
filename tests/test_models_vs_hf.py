"""Every family against Hugging Face transformers (torch, float32) on the same weights."""
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from tests.hf_models import CASES, hf_greedy, hf_logprobs

PROMPT_LENS = (3, 17, 40, 70)   # 70 > the 64-token budget: chunked prefill


def _prompts(seed=0):
    rs = np.random.RandomState(seed)
    return [[int(t) for t in rs.randint(0, 512, size=n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, hf_model_factory):
    hf, path = hf_model_factory(request.param)
    llm = LLM(path, max_num_seqs=4, max_model_len=160, page_size=16, max_num_batched_tokens=64)
    return request.param, hf, llm


def test_greedy_matches_hf_with_batched_requests(case):
    name, hf, llm = case
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32), f"{name}: prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"


def test_logprobs_match_hf(case):
    name, hf, llm = case
    prompts = _prompts(seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1,
                                                prompt_logprobs=1))
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        ref = hf_logprobs(hf, prompt + gen)          # [len, vocab]
        full = prompt + gen
        # prompt logprobs: entry i is log p(prompt[i] | prompt[:i]); the first is None
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            got = out.prompt_logprobs[i][prompt[i]].logprob
            assert abs(got - ref[i - 1, prompt[i]]) < 1e-4, (name, i)
        for j, tok in enumerate(gen):
            got = out.outputs[0].logprobs[j][tok].logprob
            assert abs(got - ref[len(prompt) + j - 1, full[len(prompt) + j]]) < 1e-4, (name, j)


def test_requests_joining_at_different_times_match_hf(case):
    """Requests arrive while others decode: pages and slots keep every sequence apart."""
    name, hf, llm = case
    engine = llm.engine
    prompts = _prompts(seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"join-{i}", p, params)
        engine.step()
        step += 1
    for i, p in enumerate(prompts):
        req = engine.requests[f"join-{i}"][0]
        assert req.output_token_ids == hf_greedy(hf, p, 20), (name, i)
        engine.release(f"join-{i}")
    assert engine.pool.num_free_pages == engine.pool.num_pages   # every page back in the pool

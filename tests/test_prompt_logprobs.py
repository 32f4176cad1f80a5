"""Prompt logprobs: prefill steps that record them run one token count (`EngineConfig.prompt_logprobs_tokens`,
compiled by the warm-up), so a long prompt prefills in chunks of at most that many tokens; the logprobs equal
those of one whole-prompt prefill.

The `tiny` bench preset (random weights, fast compiles). The cap (512 by default) is lowered here so that
short prompts take several chunks.
"""
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams, engine_config
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig

GREEDY = dict(temperature=0, ignore_eos=True)


def _llm(loaded, monkeypatch, cap, **kw):
    monkeypatch.setattr(engine_config, "PROMPT_LOGPROBS_TOKENS", cap)   # read when the engine is built
    args = dict(max_num_seqs=4, max_model_len=160, page_size=8, max_num_batched_tokens=128)
    return LLM.from_engine(LLMEngine(EngineConfig(**{**args, **kw}), loaded=loaded))


def _record_prefills(engine):
    """[[(request id, start, num_tokens) per chunk] per scheduled step with prefills]."""
    seen, schedule = [], engine.scheduler.schedule

    def record(**kw):
        out = schedule(**kw)
        if out.prefills:
            seen.append([(c.request.request_id, c.start, c.num_tokens) for c in out.prefills])
        return out
    engine.scheduler.schedule = record
    return seen


def _prompts(lengths, seed=0):
    rs = np.random.RandomState(seed)
    return [[int(t) for t in rs.randint(0, 512, size=n)] for n in lengths]


def _assert_same_logprobs(got, want, tokens):
    """Per position: the same tokens (the top ones and the chosen one), ranks and logprobs."""
    assert len(got) == len(want) == len(tokens)
    for pos, (g, w, tok) in enumerate(zip(got, want, tokens)):
        assert tok in g and g.keys() == w.keys(), pos
        for t in g:
            assert g[t].rank == w[t].rank and g[t].logprob == pytest.approx(w[t].logprob, abs=1e-5), pos


def _assert_same_prompt_logprobs(got, want, prompt):
    assert got[0] is None and want[0] is None    # the first prompt token has none
    _assert_same_logprobs(got[1:], want[1:], prompt[1:])


def test_a_config_runs_one_prompt_logprob_prefill_size_within_its_buckets():
    for budget in (64, 300, 512, 8192):
        config = EngineConfig(max_num_batched_tokens=budget)
        assert config.prompt_logprobs_tokens == min(engine_config.PROMPT_LOGPROBS_TOKENS, budget)
        assert config.prompt_logprobs_tokens in config.prefill_buckets()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_capped_chunks_give_the_prompt_logprobs_of_one_whole_prefill(tiny, monkeypatch, async_scheduling):
    prompts = _prompts((100, 40, 7))
    params = [SamplingParams(max_tokens=6, prompt_logprobs=3, **GREEDY),
              SamplingParams(max_tokens=9, prompt_logprobs=1, logprobs=2, **GREEDY),
              SamplingParams(max_tokens=30, **GREEDY)]             # decodes while the others prefill
    whole = _llm(tiny, monkeypatch, 512, async_scheduling=async_scheduling)
    capped = _llm(tiny, monkeypatch, 16, async_scheduling=async_scheduling)
    seen = _record_prefills(capped.engine)
    want = whole.generate(prompts, params)
    got = capped.generate(prompts, params)
    chunks = [c for step in seen for c in step]
    assert sum(1 for c in chunks if c[0] == "0") > 100 // 16          # the long prompt took several steps
    assert all(sum(n for *_, n in step) <= 16 for step in seen if {"0", "1"} & {rid for rid, *_ in step})
    for prompt, g, w in zip(prompts, got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if w.prompt_logprobs is not None:
            _assert_same_prompt_logprobs(g.prompt_logprobs, w.prompt_logprobs, prompt)
    _assert_same_logprobs(got[1].outputs[0].logprobs, want[1].outputs[0].logprobs, got[1].outputs[0].token_ids)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_prompt_logprob_request_preempted_mid_prompt_still_gets_every_position(tiny, monkeypatch,
                                                                                  async_scheduling):
    """A pool of 20 pages: the decoding request grows into the pages the long prompt's chunks need, the
    prompt's request gives way (it is the newest) and later prefills its prompt again."""
    prompt, other = _prompts((100, 60), seed=1)
    lp = SamplingParams(max_tokens=4, prompt_logprobs=2, **GREEDY)
    want = _llm(tiny, monkeypatch, 512).generate([prompt], lp)[0]
    llm = _llm(tiny, monkeypatch, 16, num_pages=20, async_scheduling=async_scheduling)
    seen = _record_prefills(llm.engine)
    got = llm.generate([other, prompt], [SamplingParams(max_tokens=90, **GREEDY), lp])[1]
    starts = [start for step in seen for rid, start, _ in step if rid == "1"]
    assert any(b <= a for a, b in zip(starts, starts[1:]))        # preempted mid-prompt: prefilled again
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    _assert_same_prompt_logprobs(got.prompt_logprobs, want.prompt_logprobs, prompt)


def test_a_warmed_up_engine_compiles_nothing_for_prompt_logprobs(tiny, monkeypatch):
    llm = _llm(tiny, monkeypatch, 32, max_num_batched_tokens=64, compile_at_start=True)
    runner = llm.engine.runner
    compiled, n = set(runner._compiled), runner.num_compiles
    prompts = _prompts((3, 17, 33, 70, 120), seed=2)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=3, prompt_logprobs=1, **GREEDY)] * len(prompts))
    assert [len(o.prompt_logprobs) for o in outs] == [len(p) for p in prompts]
    llm.generate(prompts[:2], SamplingParams(max_tokens=3, prompt_logprobs=1, **GREEDY))   # 2 at once
    assert runner.num_compiles == n and set(runner._compiled) == compiled
    one = ("prefill", llm.engine.config.prompt_logprobs_tokens, True)
    assert [k for k in compiled if k[0] == "prefill" and k[2]] == [one]     # the one prompt-logprob prefill

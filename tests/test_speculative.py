"""n-gram speculative decoding (atlasjax/speculative.py): the drafts change how many tokens a step emits,
never which: greedy and seeded sampling give the tokens (and logprobs) of plain decoding, stops and limits
land where they would, every page comes back, and the prefix cache never keeps a draft's K/V."""
import json

import jax
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError
from atlasjax.speculative import SpeculativeConfig, num_accepted, propose
from tests.test_engine import _alone, _assert_idle, _run_staggered, _workload

# float32 everywhere: on a GPU in bf16 (its default) a verify's rows round unlike a decode's (logprobs within 0.005),
# and a seeded draw between near-equal tokens of this random model flipped there (session 68)
ENGINE = dict(max_num_seqs=8, max_model_len=128, page_size=8, max_num_batched_tokens=64, dtype="float32")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# a prompt whose continuation the random model (which falls into loops) and the lookup both repeat
LOOP = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]


@pytest.fixture(scope="module")
def model_dir(hf_model_factory):
    return hf_model_factory("llama_gqa4")[1]


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def spec(model_dir):
    return LLM(model_dir, speculative_config=NGRAM, **ENGINE)


# ---- the proposer and the acceptance rule
def test_propose_takes_the_latest_occurrence_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert propose(tokens, 3, 1, 3) == [4, 5, 1]           # "1 2 3" last seen at 5..7, then 4 5 1
    assert propose(tokens, 10, 1, 3) == [9, 9, 1, 2, 3, 4, 5, 1, 2, 3]   # none has 10 after it: the earliest
    assert propose([5, 6, 7, 8], 3, 1, 3) == []            # nothing recurs
    assert propose([4, 1, 4, 2, 9, 2], 2, 1, 2) == [9, 2]  # falls back to the 1-gram "2"
    assert propose([4, 1, 4, 2, 9, 2], 2, 2, 2) == []      # ... unless prompt_lookup_min forbids it
    assert propose([3], 4, 1, 4) == []
    assert propose([8, 5, 5, 5, 5, 5, 5], 3, 1, 3) == [5, 5, 5]   # a repeat drafts k tokens, not the one after
    assert propose([1, 2, 7, 1, 2, 8, 1, 2], 2, 1, 2) == [8, 1]    # latest with k tokens after it
    assert propose([1, 2, 7, 1, 2, 8, 1, 2], 4, 1, 2) == [7, 1, 2, 8]   # none has 4 after it: the earliest


def _propose_by_windows(tokens, k, min_n, max_n):
    """The lookup written plainly: every window of every n compared with the suffix."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        starts = [s for s in range(size - n) if tokens[s:s + n] == tokens[size - n:]]
        if starts:
            full = [s for s in starts if s + n + k <= size]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start:start + k]
    return []


def test_propose_equals_the_plain_window_search_and_history_follows_outputs():
    from atlasjax.request import Request
    from atlasjax.speculative import request_tokens
    rs = np.random.RandomState(0)
    for _ in range(300):
        tokens = rs.randint(0, rs.randint(2, 6), size=rs.randint(1, 40)).tolist()
        k, lo = int(rs.randint(1, 6)), int(rs.randint(1, 4))
        hi = lo + int(rs.randint(0, 3))
        assert propose(tokens, k, lo, hi) == _propose_by_windows(tokens, k, lo, hi), (tokens, k, lo, hi)
    req = Request("r", [1, 2, 3], SamplingParams(), 0, 100)
    for step in range(50):                          # grows past its first buffer
        req.output_token_ids += [step % 7] * (step % 3)
        assert request_tokens(req).tolist() == req.all_token_ids


def test_num_accepted_stops_at_the_first_difference():
    assert num_accepted([5, 6, 7, 8], [5, 6, 7]) == 3
    assert num_accepted([5, 9, 7, 8], [5, 6, 7]) == 1
    assert num_accepted([4, 6], [5]) == 0
    assert num_accepted([4], []) == 0


def test_config_parsing_and_errors():
    assert SpeculativeConfig.parse(json.dumps(NGRAM)) == SpeculativeConfig(3, 3, 1)
    default = SpeculativeConfig.parse({"num_speculative_tokens": 2})
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (5, 5)      # vLLM's defaults
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 3}).prompt_lookup_min == 3
    for bad, words in [({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
                       ({"num_speculative_tokens": 0}, "positive integer"),
                       ({"prompt_lookup_max": 3}, "needs num_speculative_tokens"),
                       ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
                       ("{not json", "not valid JSON")]:
        with pytest.raises(EngineConfigError, match=words):
            EngineConfig(speculative_config=bad)


def end_behind_a_pipelined_launch(engine, plain, prompt):
    """Two greedy requests of `prompt` well into pipelined verify-rounds launches; one is aborted, or stopped by a
    token a launch before emitted, while the launch behind still holds it: it gives its pages and slot back once
    that launch is read back, and the other's tokens stay plain decoding's (`plain`: an LLM without speculation)."""
    keep = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40)
    want = plain.generate([prompt], keep)[0].outputs[0].token_ids
    stop = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40, stop_token_ids=[want[20]])
    for end in ("abort", "stop"):
        pipelined = engine.launcher.num_pipelined_verifies
        engine.add_request("kept", prompt, keep)
        engine.add_request("ended", prompt, stop)
        ended = engine.requests["ended"][0]
        while engine.launcher.num_pipelined_verifies < pipelined + 2 and engine.has_unfinished():
            engine.step()
        assert engine.launcher.num_pipelined_verifies >= pipelined + 2
        if end == "abort":
            assert engine.abort("ended")
        while engine.has_unfinished():
            engine.step()
        assert engine.requests["kept"][0].output_token_ids == want
        if end == "stop":
            assert ended.finish_reason == "stop" and ended.output_token_ids == want[:want.index(want[20]) + 1]
        for rid in list(engine.requests):
            engine.release(rid)
        _assert_idle(engine)


# ---- the engine
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_tokens_equal_plain_decoding_with_drafts_accepted(plain, spec, async_scheduling):
    """Async scheduling (the default) drafts for a request whose newest token is still on the device, by looking
    that token up too: the verify gathers it there, as a decode step does."""
    prompts = [LOOP, list(range(3, 40)), [5, 9, 5, 9, 5, 9]]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    engine = spec.engine
    engine.async_scheduling = async_scheduling
    verify, gathered = engine.runner.verify, []

    def record(batch, *args, **kw):
        gathered.append(int((batch["tokens"] < 0).sum()))
        return verify(batch, *args, **kw)
    engine.runner.verify = record
    try:
        before = engine.stats.spec.num_accepted_tokens
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
        assert engine.stats.spec.num_accepted_tokens > before        # drafts did the work ...
        steps = engine.stats.num_steps
        spec.generate([prompts[2]], params)                           # ... in fewer steps than tokens
        assert engine.stats.num_steps - steps < 24
    finally:
        engine.runner.verify, engine.async_scheduling = verify, True
    assert any(gathered) == async_scheduling                          # a token still on the device
    _assert_idle(engine)


def test_seeded_sampling_and_logprobs_equal_plain_decoding(plain, spec):
    prompts = [LOOP, [5, 9, 5, 9, 5]]
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True,
                             logprobs=3),
              SamplingParams(temperature=0.5, min_p=0.05, seed=4, max_tokens=12, min_tokens=6, logprobs=1)]
    for a, b in zip(plain.generate(prompts, params), spec.generate(prompts, params)):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        for da, db in zip(a.logprobs, b.logprobs):
            assert da.keys() == db.keys()
            # (GPU float32 matmuls run in TF32, tiled differently for a verify's rows than a decode's)
            np.testing.assert_allclose([v.logprob for v in da.values()], [v.logprob for v in db.values()],
                                       atol=5e-3 if jax.default_backend() == "gpu" else 1e-4)
    _assert_idle(spec.engine)


def test_penalties_and_bad_words_decode_plainly_and_match(plain, spec):
    prompts = [LOOP, LOOP]
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=10,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    drafted = spec.engine.stats.spec.num_draft_tokens
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    # a step with a penalized request proposes no drafts for anyone (its counts advance only in decode steps)
    assert spec.engine.stats.spec.num_draft_tokens == drafted
    _assert_idle(spec.engine)


@pytest.mark.parametrize("stop_at", [1, 4])
def test_stop_token_or_string_inside_accepted_drafts(plain, spec, stop_at):
    free = plain.generate([LOOP], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    stop_token = free.token_ids[stop_at]
    if stop_token in free.token_ids[:stop_at]:
        pytest.skip("the chosen stop token occurs earlier in this model's output")
    for params in (SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token]),
                   SamplingParams(temperature=0, max_tokens=stop_at + 1, ignore_eos=True)):
        a = plain.generate([LOOP], params)[0].outputs[0]
        b = spec.generate([LOOP], params)[0].outputs[0]
        assert (b.token_ids, b.finish_reason, b.stop_reason) == (a.token_ids, a.finish_reason, a.stop_reason)
        assert len(b.token_ids) == stop_at + 1
    _assert_idle(spec.engine)


def test_steps_without_drafts_run_multi_step_decodes(model_dir, plain):
    """num_scheduler_steps K: a step where nobody has a draft decodes K tokens in one launch, a step with drafts
    verifies them; the tokens stay plain decoding's."""
    llm = LLM(model_dir, speculative_config=NGRAM, num_scheduler_steps=4, **ENGINE)
    prompts = [LOOP, list(range(3, 40))]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert any(k[0] == "decode" and len(k) == 4 for k in llm.engine.runner._compiled)   # a multi-step launch
    assert llm.engine.stats.spec.num_draft_tokens > 0                                     # and verify steps
    # (how many drafts are accepted depends on the random model's tokens: on an H200 in TF32, none were)
    _assert_idle(llm.engine)


def test_staggered_requests_and_preemption_equal_plain_decoding(model_dir):
    work = _workload(n=16, seed=3)
    want = _alone(LLM(model_dir, enable_prefix_caching=False, **ENGINE).engine, work)
    engine = LLM(model_dir, speculative_config=NGRAM, num_pages=24, enable_prefix_caching=False, **ENGINE).engine
    assert _run_staggered(engine, work) == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.spec.num_accepted_tokens > 0
    _assert_idle(engine)


def test_prefix_cache_keeps_no_draft(spec, plain):
    """Pages a verify step writes past the accepted drafts are never registered: a later request that shares
    the first request's prompt and output reuses its pages and continues exactly as plain decoding does."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=20)
    first = spec.generate([LOOP], params)[0].outputs[0].token_ids
    follow_up = LOOP + list(first) + [3]
    hits = spec.engine.pool.num_hit_pages
    got = spec.generate([follow_up], params)[0].outputs[0].token_ids
    assert spec.engine.pool.num_hit_pages > hits
    assert got == plain.generate([follow_up], params)[0].outputs[0].token_ids
    _assert_idle(spec.engine)


# ---- the server
def test_cli_flag_reaches_the_engine_config():
    import argparse

    from atlasjax.__main__ import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--speculative-config", json.dumps(NGRAM)]))
    assert EngineConfig(**kw).speculative_config == SpeculativeConfig(3, 3, 1, method="ngram")
    assert engine_kwargs(p.parse_args([]))["speculative_config"] is None
    draft = EngineConfig(**engine_kwargs(p.parse_args(
        ["--speculative-config", '{"model": "/models/draft", "num_speculative_tokens": 5}']))).speculative_config
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/draft", 5)
    head = EngineConfig(**engine_kwargs(p.parse_args(["--speculative-config", json.dumps(
        {"method": "eagle3", "model": "/models/head", "num_speculative_tokens": 3})]))).speculative_config
    assert (head.method, head.model, head.num_speculative_tokens, head.uses_draft_model) == (
        "eagle3", "/models/head", 3, True)


@pytest.mark.parametrize("drafts", ["ngram", "draft_model", "draft_model_rounds"])
def test_served_stream_equals_plain_decoding_and_metrics_count_drafts(tmp_path_factory, drafts):
    """n-gram drafts (a logit bias makes the random model repeat one token, so the lookup drafts it), or the model
    drafting for itself (atlasjax/draft_model.py: every greedy draft accepted), one verify round per launch or three
    (verify_rounds.py; the engine compiled at start, as `serve` does, compiles nothing more while serving; its
    launches pipelined)."""
    import asyncio

    import httpx

    from atlasjax.async_llm import AsyncLLM
    from serving.app import create_app
    from tests.server_util import ENGINE_KWARGS, MODEL_NAME, greedy_reference, metric_value, reference_llm, \
        tiny_model_dir
    prompt = "one two three one two three one two three one two"
    # the random model does not repeat itself; a bias that wins the first pick does (drafts of it all accepted)
    bias = {1603: 30.0} if drafts == "ngram" else {}
    want = greedy_reference(reference_llm(tmp_path_factory), [prompt], 24, ignore_eos=True,
                            logit_bias=bias)[0].outputs[0].text
    model = tiny_model_dir(tmp_path_factory)
    spec = NGRAM if drafts == "ngram" else {"model": model, "num_speculative_tokens": 3}
    rounds = dict(num_scheduler_steps=3, compile_at_start=True) if drafts == "draft_model_rounds" else {}
    engine = AsyncLLM(model, **ENGINE_KWARGS, speculative_config=spec, **rounds)
    runner = engine.engine.runner if rounds else None
    compiled = runner.num_compiles if rounds else None
    app = create_app(engine, served_model_name=MODEL_NAME)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "logit_bias": {str(k): v for k, v in bias.items()}}
            text = ""
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            whole = (await client.post("/v1/completions", json=body)).json()
            return text, whole, (await client.get("/metrics")).text
    try:
        streamed, whole, metrics = asyncio.run(go())
    finally:
        engine.shutdown(drain=False)
    assert streamed == whole["choices"][0]["text"] == want
    assert whole["usage"]["completion_tokens"] == 24
    drafted = metric_value(metrics, "atlasjax_spec_decode_num_draft_tokens_total")
    accepted = metric_value(metrics, "atlasjax_spec_decode_num_accepted_tokens_total")
    assert drafted >= accepted > 0
    assert metric_value(metrics, 'atlasjax_spec_decode_num_accepted_tokens_per_pos_total{position="0"}') > 0
    if rounds:
        assert runner.num_compiles == compiled and any(k[0] == "verify" and k[-1] == 3 for k in runner._compiled)
        assert drafted == accepted   # every round's drafts accepted: the draft's cache followed every round
        assert engine.engine.launcher.num_pipelined_verifies > 0   # launches scheduled behind the one in flight


@pytest.mark.parametrize("steps", [None, 4], ids=["default", "4_rounds"])
def test_compiled_at_start_with_every_sampling_feature(tiny, steps):
    """A server's engine (compile_at_start) warms the verify steps up too: the mixed workload of
    test_async_scheduling (seeded sampling with filters, penalties, logprobs, prompt logprobs, stop strings, n=2,
    staggered arrivals) compiles nothing more and yields plain decoding's completions; with 4 rounds a launch (the
    GPU default: n-gram drafts looked up on the device) too."""
    from atlasjax.engine import LLMEngine
    from tests.test_async_scheduling import _mixed_workload, _run

    def engine(**kw):
        return LLMEngine(EngineConfig(max_num_seqs=8, max_model_len=80, page_size=8, max_num_batched_tokens=64,
                                      num_pages=81, **kw), loaded=tiny)

    def completions(results):
        return {rid: [seq[:4] for seq in seqs] for rid, seqs in results.items()}
    work = _mixed_workload(n=12, seed=3)
    want, _ = _run(engine(), work)
    spec = engine(speculative_config=NGRAM, compile_at_start=True, num_scheduler_steps=steps)
    compiled = spec.runner.num_compiles
    # 4 plans, each one round a launch and (GPU: num_scheduler_steps 4, n-gram drafts looked up on the device) 4
    rounds = sorted({1, spec.runner.verify_rounds})
    assert sorted((k[1], k[3] if len(k) > 3 else 1) for k in spec.runner._compiled if k[0] == "verify") == \
        sorted((t, r) for t in (16, 32) for r in rounds for _ in range(4))
    got, deltas = _run(spec, work)
    assert completions(got) == completions(want)
    assert spec.runner.num_compiles == compiled
    assert spec.stats.spec.num_drafts > 0
    for (rid, index), ds in deltas.items():          # the streamed text adds up to the final one
        assert "".join(d["new_text"] for d in ds) == got[rid][index][1]


# ---- the scheduler's drafts (plain Python)
def _decoding(scheduler, rid, tokens, max_tokens=20, **params):
    """A running request whose prompt `tokens` is computed but its last token (as after its prefill)."""
    from atlasjax.request import Request
    req = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **params), 0, max_tokens)
    scheduler.add(req)
    out = scheduler.schedule()
    assert [c.request for c in out.prefills] == [req]
    req.output_token_ids.append(tokens[-4])          # continues the loop: the lookup finds it again
    req.num_computed_tokens = req.num_tokens - 1
    return req


def _scheduler(num_pages=32, budget=64, **spec):
    from atlasjax.page_pool import PagePool
    from atlasjax.scheduler import Scheduler
    return Scheduler(PagePool(num_pages, 4, True), max_num_seqs=4, max_num_batched_tokens=budget,
                     speculative=SpeculativeConfig(**{**dict(num_speculative_tokens=3, prompt_lookup_max=3,
                                                             prompt_lookup_min=1), **spec}))


def test_drafts_respect_max_tokens_budget_pages_and_batch_size():
    s = _scheduler()
    a = _decoding(s, "a", LOOP)
    out = s.schedule()
    assert out.decodes == [a] and len(out.drafts[a]) == 3
    # pages cover the last token and every draft; computed is optimistic until the verify is read back
    assert len(a.pages) * 4 >= a.num_tokens + 3 and a.num_computed_tokens == a.num_tokens + 3
    a.output_token_ids += [9] * 17                   # 18 of 20 generated: one more token and one draft at most
    a.num_computed_tokens = a.num_tokens - 1
    assert len(s.schedule().drafts[a]) == 1

    s = _scheduler(budget=3)                         # the budget holds the decode and two drafts
    b = _decoding(s, "b", LOOP)
    assert len(s.schedule().drafts[b]) == 2

    s = _scheduler(disable_by_batch_size=2)
    c, d = _decoding(s, "c", LOOP), _decoding(s, "d", LOOP[1:])
    assert s.schedule().drafts == {}                 # 2 running: drafting is off
    s.finish(d, "abort")
    c.num_computed_tokens = c.num_tokens - 1
    assert len(s.schedule().drafts[c]) == 3

    s = _scheduler(num_pages=4)                      # 16 tokens of pages: 15 known, room for one draft
    e = _decoding(s, "e", LOOP)
    assert e.num_tokens == 15 and s.schedule().drafts[e] == [LOOP[-3]]


def test_verify_rounds_get_their_pages_within_max_tokens_and_never_preempt():
    """Drafts proposed on the device run num_scheduler_steps verify rounds a launch (verify_rounds.py); each request
    gets pages for what its rounds may write (4 rounds of its last token and 3 drafts, within what its max_tokens
    leaves), as far as the pool has them, preempting nobody. n-gram drafts too, once the host's lookup finds one
    (then looked up on the device, atlasjax/ngram_lookup.py); with one round a launch the host's lookups are the
    drafts."""
    from atlasjax.page_pool import PagePool
    from atlasjax.scheduler import Scheduler
    from atlasjax.speculative import DRAFT_ON_DEVICE

    def scheduler(num_pages=32, steps=4, **spec):
        spec = spec or dict(method="draft_model", model="d")
        return Scheduler(PagePool(num_pages, 4, True), max_num_seqs=2, max_num_batched_tokens=64,
                         num_scheduler_steps=steps, speculative=SpeculativeConfig(num_speculative_tokens=3, **spec))
    s = scheduler()
    a = _decoding(s, "a", LOOP, max_tokens=40)
    out = s.schedule()
    assert out.rounds == 4 and out.drafts[a] == [DRAFT_ON_DEVICE] * 3
    assert len(a.pages) * 4 >= a.num_total_tokens - 1 + 16    # 4 rounds of 4 positions from its last token's

    s = scheduler()
    b = _decoding(s, "b", LOOP, max_tokens=6)                 # 1 of 6 generated: 5 tokens left, 3 drafts
    assert s.schedule().rounds == 4
    assert b.num_total_tokens - 1 + 5 <= len(b.pages) * 4 < b.num_total_tokens - 1 + 5 + 4   # only what is left

    s = scheduler(num_pages=5)                                # 20 positions: 15 known, 5 free
    c = _decoding(s, "c", LOOP, max_tokens=40)
    assert s.schedule().rounds == 4 and len(c.pages) == 5 and s.num_preemptions == 0   # the step stops it there

    s = scheduler(prompt_lookup_max=3, prompt_lookup_min=1)   # n-gram: rows for the device's lookups
    e = _decoding(s, "e", LOOP, max_tokens=40)
    out = s.schedule()
    assert out.drafts[e] == [DRAFT_ON_DEVICE] * 3 and out.rounds == 4

    s = scheduler(prompt_lookup_max=3, prompt_lookup_min=1)   # none found by the host: a multi-step decode
    f = _decoding(s, "f", list(range(20, 40)), max_tokens=40)
    f.output_token_ids[-1] = 99                               # a token the prompt never had
    out = s.schedule()
    assert not out.drafts and out.steps[f] == 4

    s = scheduler(steps=1, prompt_lookup_max=3, prompt_lookup_min=1)   # one round a launch: the host's drafts
    g = _decoding(s, "g", LOOP, max_tokens=40)
    out = s.schedule()
    assert out.drafts[g] == propose(LOOP + g.output_token_ids, 3, 1, 3) and out.rounds == 1


def test_a_verify_launch_is_scheduled_behind_another_only_when_it_can_run_the_same_requests():
    """Pipelined verify-rounds launches (engine.step, verify_rounds.py): the next launch is scheduled before the one in
    flight is read back only when it will be another verify-rounds launch of the same requests, each with a draft,
    with no admission, retirement or preemption; its pages then cover what both launches may write."""
    from atlasjax.draft_scheduling import verify_reach
    from atlasjax.page_pool import PagePool
    from atlasjax.request import Request
    from atlasjax.scheduler import Scheduler
    from atlasjax.speculative import DRAFT_ON_DEVICE

    def scheduler(num_pages=64, max_num_seqs=2, **spec):
        spec = spec or dict(method="draft_model", model="d")
        return Scheduler(PagePool(num_pages, 4, True), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                         num_scheduler_steps=4, speculative=SpeculativeConfig(num_speculative_tokens=3, **spec))

    def launch(s, out):   # as the engine's launcher does
        for req in out.decodes:
            s.verify_dispatched(req, verify_reach(req, len(out.drafts.get(req, ())), out.rounds))
        s.dispatched(out)
        return out

    s = scheduler()
    a = _decoding(s, "a", LOOP, max_tokens=60)
    first = launch(s, s.schedule())
    assert first.rounds == 4 and a.num_pending_tokens == 16 and not a.is_prefilling
    assert s.can_pipeline_verify(first.decodes)
    second = s.schedule()
    assert second.decodes == [a] and second.drafts[a] and second.rounds == 4 and not second.preempted
    # its pages hold what both launches may write from a's last known token on
    assert len(a.pages) * 4 >= a.num_tokens - 1 + 16 + 16

    s = scheduler()   # a request arrives that a free slot could take: read back first, then admit it
    a = _decoding(s, "a", LOOP, max_tokens=60)
    first = launch(s, s.schedule())
    s.add(Request("w", [1, 2, 3], SamplingParams(max_tokens=5), 0, 5))
    assert not s.can_pipeline_verify(first.decodes)

    s = scheduler()   # near max_tokens: what the launch in flight may emit leaves no room for a draft
    a = _decoding(s, "a", LOOP, max_tokens=18)
    assert not s.can_pipeline_verify(launch(s, s.schedule()).decodes)

    s = scheduler(num_pages=6)   # the pool cannot hold what the launch in flight may write and a draft after it
    a = _decoding(s, "a", LOOP, max_tokens=60)
    first = launch(s, s.schedule())
    assert len(a.pages) * 4 < a.num_total_tokens + 1 and not s.can_pipeline_verify(first.decodes)

    s = scheduler(max_num_seqs=3)   # another request decodes that the launch in flight does not hold
    a = _decoding(s, "a", LOOP, max_tokens=60)
    first = launch(s, s.schedule())
    _decoding(s, "b", LOOP, max_tokens=60)
    assert not s.can_pipeline_verify(first.decodes)

    s = scheduler(prompt_lookup_max=3, prompt_lookup_min=1)   # n-gram drafts looked up on the device: the same
    a = _decoding(s, "a", LOOP, max_tokens=60)
    first = launch(s, s.schedule())
    assert first.rounds == 4 and s.can_pipeline_verify(first.decodes)
    second = s.schedule(behind_verify=True)   # no lookup here (the host lacks the tokens in flight): rows for them
    assert second.drafts[a] == [DRAFT_ON_DEVICE] * 3 and second.rounds == 4
    s.drafts_accepted = False   # the launch read back last accepted nothing: the host's lookup decides again
    assert not s.can_pipeline_verify(launch(s, second).decodes)

"""Multi-step decoding (`num_scheduler_steps` K): K decode iterations per launch give the same
tokens, logprobs, stops and streams as one step per launch, and return every page."""
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from tests.test_engine import BOTH_MODES, GREEDY, _alone, _assert_idle, _run_staggered, _workload

ENGINE = dict(max_num_seqs=8, max_model_len=128, page_size=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model_dir(hf_model_factory):
    return hf_model_factory("llama_gqa4")[1]


def _engine(model_dir, k, **kw):
    return LLM(model_dir, num_scheduler_steps=k, **{**ENGINE, **kw}).engine


def _multi_step_launches(engine) -> int:
    return sum(1 for key in engine.runner._compiled if key[0] == "decode" and len(key) == 4)


@BOTH_MODES
def test_staggered_requests_equal_one_step_per_launch(model_dir, async_scheduling):
    work = _workload(n=24, seed=5)
    single = _engine(model_dir, 1, enable_prefix_caching=False, async_scheduling=async_scheduling)
    multi = _engine(model_dir, 4, enable_prefix_caching=False, async_scheduling=async_scheduling)
    want = _run_staggered(single, work)
    steps_single = single.stats.num_steps
    assert _run_staggered(multi, work) == want
    assert _multi_step_launches(multi) > 0
    assert multi.stats.num_steps < steps_single          # fewer launches for the same tokens
    _assert_idle(multi)


def test_small_pool_preempts_and_still_matches(model_dir):
    multi = _engine(model_dir, 4, num_pages=24, enable_prefix_caching=False)
    work = _workload(n=24, seed=1)
    got = _run_staggered(multi, work)
    assert multi.scheduler.num_preemptions > 0
    assert got == _alone(_engine(model_dir, 1, enable_prefix_caching=False), work)
    _assert_idle(multi)


def test_sampling_penalties_and_logprobs_match_one_step_per_launch(model_dir):
    prompts = [list(range(1, 20)), list(range(40, 47)), [5, 9, 5, 9, 5]]
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7, max_tokens=13, ignore_eos=True,
                             logprobs=3),
              SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=10,
                             ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, presence_penalty=0.7, seed=3, min_tokens=6, max_tokens=9)]
    runs = []
    for k in (1, 4):
        llm = LLM(model_dir, num_scheduler_steps=k, **ENGINE)
        runs.append(llm.generate(prompts, params))
        llm.engine.pool.reset_prefix_cache()
        _assert_idle(llm.engine)
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        if a.outputs[0].logprobs:
            for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert da.keys() == db.keys()
                np.testing.assert_allclose([v.logprob for v in da.values()], [v.logprob for v in db.values()],
                                           atol=1e-5)


@pytest.mark.parametrize("stop_at", [1, 2, 5])
def test_a_stop_inside_a_burst_drops_what_follows(model_dir, stop_at):
    prompt = list(range(3, 30))
    free = LLM(model_dir, **ENGINE).generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    stop_token = free.token_ids[stop_at]
    if stop_token in free.token_ids[:stop_at]:
        pytest.skip("the chosen stop token occurs earlier in this model's output")
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token])
    llm = LLM(model_dir, num_scheduler_steps=4, **ENGINE)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == free.token_ids[:stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    llm.engine.pool.reset_prefix_cache()
    _assert_idle(llm.engine)


def test_stream_arrives_in_bursts_that_add_up(model_dir):
    engine = _engine(model_dir, 4)
    engine.add_request("s", list(range(2, 20)), SamplingParams(max_tokens=11, **GREEDY))
    deltas = []
    while engine.has_unfinished():
        deltas += [d for d in engine.step() if d.request_id == "s"]
    req = engine.requests["s"][0]
    assert [t for d in deltas for t in d.new_token_ids] == req.output_token_ids and len(req.output_token_ids) == 11
    assert max(len(d.new_token_ids) for d in deltas) == 4            # bursts of up to K
    assert all(1 <= len(d.new_token_ids) <= 4 for d in deltas)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 11


def test_no_compile_after_warmup(model_dir):
    engine = _engine(model_dir, 4)
    engine.runner.warmup(num_steps=4)
    before = engine.runner.num_compiles
    _run_staggered(engine, _workload(n=12, seed=3))
    LLM.from_engine(engine).generate([[1, 2, 3]], SamplingParams(temperature=0.8, seed=1, max_tokens=9, logprobs=2))
    assert engine.runner.num_compiles == before


def test_async_stream_with_a_stop_string_equals_one_step_per_launch(tmp_path_factory):
    import asyncio

    from atlasjax.async_llm import AsyncLLM
    from tests.server_util import ENGINE_KWARGS, tiny_model_dir
    model = tiny_model_dir(tmp_path_factory)
    prompt = "Once upon a time"
    free = LLM(model, **ENGINE_KWARGS).generate([prompt], SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    if not stop.strip() or free.text.find(stop) < len(free.text) // 2:
        pytest.skip("no stop string that first occurs mid-output in this model's text")
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    want = LLM(model, **ENGINE_KWARGS).generate([prompt], params)[0].outputs[0]
    llm = AsyncLLM(model, num_scheduler_steps=4, **ENGINE_KWARGS)

    async def stream():
        return [d async for d in llm.generate(prompt, params)]
    try:
        deltas = asyncio.run(stream())
    finally:
        llm.shutdown()
    assert "".join(d.new_text for d in deltas) == want.text == free.text[:free.text.find(stop)]
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4"])
def test_bad_num_scheduler_steps_is_a_clear_error(bad):
    from atlasjax import EngineConfigError
    from atlasjax.engine_config import EngineConfig
    with pytest.raises(EngineConfigError, match="num_scheduler_steps must be a positive integer"):
        EngineConfig(num_scheduler_steps=bad)
    assert EngineConfig().num_scheduler_steps is None    # unset: the engine picks by platform


def test_unset_num_scheduler_steps_is_four_on_gpu_and_one_elsewhere(model_dir):
    # Issuing a step costs a GPU host 2-3 ms (XLA's launch of every kernel), more than a small or
    # quantized model's step runs: there the default launches 4 decode iterations at once.
    from atlasjax.engine_config import resolve_scheduler_steps
    assert [resolve_scheduler_steps(None, b) for b in ("gpu", "cpu", "tpu")] == [4, 1, 1]
    assert resolve_scheduler_steps(2, "gpu") == resolve_scheduler_steps(2, "cpu") == 2   # a given K is kept
    llm = LLM(model_dir, **ENGINE)
    # the engine records what it runs (the bench reports engine.config), on this CPU one step per launch
    assert llm.engine.config.num_scheduler_steps == llm.engine.scheduler.num_scheduler_steps == 1


def test_parallel_sampling_and_prefix_cache_hits_match_one_step_per_launch(model_dir):
    prompt = list(range(10, 10 + 3 * 8 + 5))       # 3 full pages of 8 + 5 tokens
    params = SamplingParams(n=3, temperature=1.0, max_tokens=11, seed=99, ignore_eos=True)
    runs = []
    for k in (1, 4):
        llm = LLM(model_dir, num_scheduler_steps=k, **ENGINE)
        first = llm.generate([prompt], params)[0]
        again = llm.generate([prompt], params)[0]     # served from the prefix cache
        assert again.num_cached_tokens == 3 * 8
        assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
        runs.append([o.token_ids for o in first.outputs])
        llm.engine.pool.reset_prefix_cache()
        _assert_idle(llm.engine)
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) > 1

"""Continuous batching end to end on a tiny real model: isolation, preemption, aborts, prefix cache, n>1."""
import numpy as np
import pytest

from atlasjax import LLM, InvalidRequestError, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)
# The key behaviours run with asynchronous scheduling (the default) and without it.
BOTH_MODES = pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])


@pytest.fixture(scope="module")
def model_dir(hf_model_factory):
    return hf_model_factory("llama_gqa4")[1]


def _engine(model_dir, **kw):
    args = dict(max_num_seqs=8, max_model_len=128, page_size=8, max_num_batched_tokens=64)
    args.update(kw)
    return LLM(model_dir, **args).engine


def _workload(n=64, seed=0):
    rs = np.random.RandomState(seed)
    return [([int(t) for t in rs.randint(0, 512, size=rs.randint(1, 60))], int(rs.randint(1, 24)),
             int(rs.randint(0, 40))) for _ in range(n)]   # (prompt, max_tokens, arrival step)


def _run_staggered(engine, work):
    pending = sorted(enumerate(work), key=lambda x: x[1][2])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (prompt, n, _) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, **GREEDY))
        engine.step()
        step += 1
    outs = [engine.requests[f"r{i}"][0].output_token_ids for i in range(len(work))]
    for i in range(len(work)):
        engine.release(f"r{i}")
    return outs


def _alone(engine, work):
    outs = []
    for i, (prompt, n, _) in enumerate(work):
        engine.add_request(f"a{i}", prompt, SamplingParams(max_tokens=n, **GREEDY))
        while engine.has_unfinished():
            engine.step()
        outs.append(engine.requests[f"a{i}"][0].output_token_ids)
        engine.release(f"a{i}")
    return outs


def _assert_idle(engine):
    assert engine.pool.num_free_pages == engine.pool.num_pages
    assert all(c == 0 for c in engine.pool.ref_counts)
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_num_seqs))
    assert not engine.scheduler.running and not engine.scheduler.waiting


@BOTH_MODES
def test_64_staggered_requests_equal_their_solo_runs(model_dir, async_scheduling):
    engine = _engine(model_dir, enable_prefix_caching=False, async_scheduling=async_scheduling)
    work = _workload()
    assert _run_staggered(engine, work) == _alone(engine, work)
    _assert_idle(engine)


@BOTH_MODES
def test_small_pool_preempts_and_still_matches(model_dir, async_scheduling):
    engine = _engine(model_dir, num_pages=24, enable_prefix_caching=False,   # 8 slots x 128 tokens would need 128
                     async_scheduling=async_scheduling)
    work = _workload(n=24, seed=1)
    staggered = _run_staggered(engine, work)
    assert engine.scheduler.num_preemptions > 0
    assert staggered == _alone(engine, work)
    _assert_idle(engine)


@BOTH_MODES
def test_abort_mid_generation_returns_every_page(model_dir, async_scheduling):
    engine = _engine(model_dir, async_scheduling=async_scheduling)
    for i in range(6):
        engine.add_request(f"x{i}", list(range(1, 30 + i)), SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(5):
        engine.step()
    assert engine.pool.num_used_pages > 0
    for i in range(0, 6, 2):
        assert engine.abort(f"x{i}")
    while engine.has_unfinished():
        engine.step()
    for i in range(1, 6, 2):
        engine.release(f"x{i}")
    engine.pool.reset_prefix_cache()
    _assert_idle(engine)
    assert not engine.abort("no-such-request")


@BOTH_MODES
def test_shared_prefix_hits_the_cache_with_the_same_output(model_dir, async_scheduling):
    engine = _engine(model_dir, async_scheduling=async_scheduling)
    llm = LLM.from_engine(engine)
    prompt = list(range(10, 10 + 3 * 8 + 5))       # 3 full pages of 8 + 5 tokens
    first = llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0]
    second = llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 3 * 8
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    off = LLM(model_dir, max_num_seqs=8, max_model_len=128, page_size=8, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    off.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))
    assert off.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0].num_cached_tokens == 0


def test_prompt_logprobs_cover_every_prompt_token_despite_a_cache_hit(model_dir):
    llm = LLM.from_engine(_engine(model_dir))
    prompt = list(range(10, 10 + 3 * 8 + 5))
    want = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY))[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY))[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert plain.num_cached_tokens == 3 * 8          # the pages are cached ...
    assert again.num_cached_tokens == 0              # ... but a prompt-logprobs request computes them all
    assert len(again.prompt_logprobs) == len(prompt)
    for d, w, tok in zip(again.prompt_logprobs[1:], want.prompt_logprobs[1:], prompt[1:]):
        assert d[tok].logprob == pytest.approx(w[tok].logprob, abs=1e-5)


@BOTH_MODES
def test_parallel_sampling_n4_is_seeded(model_dir, async_scheduling):
    llm = LLM(model_dir, max_num_seqs=8, max_model_len=128, page_size=8, max_num_batched_tokens=64,
              async_scheduling=async_scheduling)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    a = llm.generate([list(range(1, 20))], params)[0]
    b = llm.generate([list(range(1, 20))], params)[0]
    assert len(a.outputs) == 4 and [o.index for o in a.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1      # own seed stream each
    assert b.num_cached_tokens == 16                              # the prompt's 2 full pages were shared


def test_no_compile_after_warmup_in_a_mixed_workload(model_dir):
    engine = _engine(model_dir)
    engine.runner.warmup()
    before = engine.runner.num_compiles
    _run_staggered(engine, _workload(n=16, seed=3))
    llm = LLM.from_engine(engine)
    llm.generate([[1, 2, 3], list(range(50))], [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1),
                                                 SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=3)])
    assert engine.runner.num_compiles == before


def test_request_that_can_never_fit_is_rejected(model_dir):
    engine = _engine(model_dir)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("big", list(range(100)), SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("huge", list(range(200)), SamplingParams(max_tokens=1))
    _assert_idle(engine)


def test_every_compile_is_logged_as_one_structured_line(model_dir, caplog):
    import json
    import logging

    from atlasjax.sampling import SamplingPlan
    caplog.set_level(logging.INFO, logger="atlasjax.compile")
    engine = _engine(model_dir)
    engine.runner.warmup()
    messages = [r.getMessage() for r in caplog.records if r.name == "atlasjax.compile"]
    lines = [m for m in messages if m.startswith("compile ")]
    # decode: one per sampling plan; prefill: one per bucket and one with prompt logprobs; admit: one
    num_decode = len(SamplingPlan.variants())
    assert len(lines) == engine.runner.num_compiles == len(engine.config.prefill_buckets()) + 1 + num_decode + 1
    first = json.loads(lines[0].split(" ", 1)[1])
    assert first["step"] == "decode" and first["seconds"] > 0 and first["num_compiles"] == 1
    # and one summary of the warm-up: its programs, time and the kernel lowering memo's hits and misses
    [summary] = [json.loads(m.split(" ", 1)[1]) for m in messages if m.startswith("warmup ")]
    assert summary["programs"] == len(lines) and summary["seconds"] >= summary["lower_seconds"] > 0
    assert set(summary["kernel_lowering_memo"]) == {"hits", "misses"}   # installed here too; lowers nothing on CPU


def test_kv_pool_keeps_to_the_largest_free_block():
    """After a load that quantized weights the free memory is in holes: the pool's per-layer arrays
    each need one free block, and the reserve (the autotuner's copy of a GEMM operand) one more."""
    from atlasjax.kv_budget import kv_pool_pages
    gib, page = 1 << 30, 1 << 20
    whole = dict(bytes_limit=60 * gib, bytes_in_use=6 * gib, largest_free_block_bytes=54 * gib)
    holed = dict(whole, largest_free_block_bytes=41 * gib)
    reserve = 2 * gib
    assert kv_pool_pages(whole, page, reserve, 0.85) * page == int(52 * gib * 0.85) // page * page
    assert kv_pool_pages(holed, page, reserve, 0.85) * page == 39 * gib     # 41 GiB block less the reserve
    assert kv_pool_pages(dict(bytes_limit=60 * gib, bytes_in_use=6 * gib), page, reserve, 0.5) * page == 26 * gib
    assert kv_pool_pages(dict(holed, largest_free_block_bytes=gib), page, reserve, 0.85) == 1   # never below one


def test_a_gpu_without_allocator_statistics_is_sized_from_the_driver(monkeypatch):
    """Under XLA's VMM allocator (a tensor-parallel server's) `memory_stats()` is None: the pool is then sized
    from the driver's free and total memory within jax's share of it, not from the CPU's 2 GiB fallback."""
    from atlasjax import device_memory
    gib = 1 << 30

    class VmmGpu:
        platform, local_hardware_id = "gpu", 1

        def memory_stats(self):
            return None
    asked = []
    monkeypatch.setattr(device_memory, "driver_memory", lambda ordinal: asked.append(ordinal) or (120 * gib, 140 * gib))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    stats = device_memory.memory_stats(VmmGpu())
    assert asked == [1] and stats == {"bytes_limit": int(0.75 * 140 * gib), "bytes_in_use": 20 * gib}
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert device_memory.memory_stats(VmmGpu())["bytes_limit"] == int(0.9 * 140 * gib)
    monkeypatch.setattr(device_memory, "driver_memory", lambda ordinal: None)
    assert device_memory.memory_stats(VmmGpu()) is None
    import jax
    assert device_memory.memory_stats(jax.devices("cpu")[0]) is None    # the CPU: no figures, no driver asked

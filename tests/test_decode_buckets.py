"""Decode batch buckets: a decode step runs the smallest compiled row count that holds its requests,
row r continuing the request in whatever slot it holds; results match the full-size step's.

The `tiny` bench preset (random weights, word tokenizer "w{i}") and the mixed workload of
test_async_scheduling (greedy, seeded sampling with filters and penalties, logprobs, stop strings,
n=2, staggered arrivals).
"""
import pytest

from atlasjax import EngineConfigError, SamplingParams
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from tests.test_async_scheduling import _mixed_workload, _run


def _engine(loaded, **kw):
    # pages for every slot's longest sequence, so that on a GPU the two engines of a test both fit
    # (the default sizes the pool from free device memory)
    args = dict(max_num_seqs=16, max_model_len=80, page_size=8, max_num_batched_tokens=64)
    args["num_pages"] = kw.get("max_num_seqs", 16) * 10 + 1
    return LLMEngine(EngineConfig(**{**args, **kw}), loaded=loaded)


def _record_decodes(engine):
    """[(rows, slots of the live rows)] per decode the engine dispatches."""
    seen, decode = [], engine.runner.decode

    def record(tokens, page_table, seq_lens, *args, **kw):
        slots = args[-1]
        seen.append((len(tokens), sorted(int(s) for s, n in zip(slots, seq_lens) if n > 0)))
        return decode(tokens, page_table, seq_lens, *args, **kw)
    engine.runner.decode = record
    return seen


def test_default_buckets_are_powers_of_two_from_8_then_every_slot():
    assert EngineConfig().decode_buckets(16) == (8, 16)
    assert EngineConfig().decode_buckets(100) == (8, 16, 32, 64, 100)
    assert EngineConfig().decode_buckets(8) == (8,)
    assert EngineConfig().decode_buckets(3) == (3,)
    assert EngineConfig(decode_batch_sizes=(12, 4, 64)).decode_buckets(16) == (4, 12, 16)
    assert EngineConfig(decode_batch_sizes=(16,)).decode_buckets(16) == (16,)


@pytest.mark.parametrize("sizes", [(), (0, 8), [8], (8, "16")])
def test_bad_decode_batch_sizes_are_refused(sizes):
    with pytest.raises(EngineConfigError, match="decode_batch_sizes"):
        EngineConfig(decode_batch_sizes=sizes)


@pytest.mark.parametrize("mode", [dict(), dict(async_scheduling=False), dict(num_scheduler_steps=3)],
                         ids=["async", "sync", "multi_step"])
def test_small_buckets_give_the_full_size_results(tiny, mode):
    """As the batch drains, decodes move to the 8-row step while requests still hold slots 8-15:
    tokens, text, logprobs and penalties (per-slot counts gathered by row) match 16-row steps."""
    work = _mixed_workload(n=24, seed=3)
    full = _engine(tiny, decode_batch_sizes=(16,), **mode)
    bucketed = _engine(tiny, **mode)
    assert bucketed.runner.decode_buckets == (8, 16) and full.runner.decode_buckets == (16,)
    seen = _record_decodes(bucketed)
    want, _ = _run(full, work)
    got, _ = _run(bucketed, work)
    assert got == want
    assert {rows for rows, _ in seen} == {8, 16}
    assert any(rows == 8 and max(slots) >= 8 for rows, slots in seen), "no 8-row step ran a slot past 7"
    assert all(len(slots) <= rows for rows, slots in seen)
    for engine in (full, bucketed):
        assert engine.pool.num_free_pages == engine.pool.num_pages


def test_a_lone_request_runs_the_smallest_step(tiny):
    engine = _engine(tiny, max_num_seqs=64)
    seen = _record_decodes(engine)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    assert len(engine.requests["a"][0].output_token_ids) == 6
    assert seen and all(rows == 8 for rows, _ in seen)
    assert ("decode", 64) not in {k[:2] for k in engine.runner._compiled}   # the 64-row step never compiled


def test_warmup_compiles_every_bucket_in_threads(tiny):
    engine = _engine(tiny, max_num_seqs=32, decode_batch_sizes=(8,), num_scheduler_steps=2)
    engine.runner.warmup(2, threads=3)
    decodes = sorted((k[1], len(k)) for k in engine.runner._compiled if k[0] == "decode")
    # 4 sampling plans (greedy or sampled, with or without logprobs), one step and two per launch, at 8 and 32 rows
    assert decodes == [(8, 3)] * 4 + [(8, 4)] * 4 + [(32, 3)] * 4 + [(32, 4)] * 4
    assert engine.runner.num_compiles == len(engine.runner._compiled)
    n = engine.runner.num_compiles
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.num_compiles == n      # serving compiles nothing more


def test_engine_and_bench_flags_reach_the_config():
    import argparse

    from atlasjax.__main__ import add_engine_args, engine_kwargs
    from atlasjax.bench.__main__ import build_parser
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--decode-batch-sizes", "8,32", "--gpu-memory-utilization", "0.5"]))
    assert kw["decode_batch_sizes"] == (8, 32) and kw["gpu_memory_utilization"] == 0.5
    assert EngineConfig(**kw).decode_buckets(64) == (8, 32, 64)
    assert engine_kwargs(p.parse_args([]))["decode_batch_sizes"] is None
    with pytest.raises(SystemExit):
        p.parse_args(["--decode-batch-sizes", "8,many"])
    args = build_parser().parse_args(["latency", "--preset", "tiny", "--decode-batch-sizes", "16"])
    assert args.decode_batch_sizes == (16,)


def test_preemption_under_small_buckets_gives_the_full_size_results(tiny):
    """A KV pool of 4 full-length sequences: decodes preempt and recompute, at whatever bucket."""
    work = _mixed_workload(n=20, seed=5)
    full = _engine(tiny, decode_batch_sizes=(16,), num_pages=41)
    bucketed = _engine(tiny, num_pages=41)
    want, _ = _run(full, work)
    got, _ = _run(bucketed, work)
    assert got == want
    assert bucketed.scheduler.num_preemptions > 0
    assert bucketed.scheduler.num_preemptions == full.scheduler.num_preemptions
    for engine in (full, bucketed):
        assert engine.pool.num_free_pages == engine.pool.num_pages


def test_compile_at_start_compiles_before_the_pool_and_serves_the_same(tiny, monkeypatch):
    """A server's engine compiles every step shape before it allocates the KV pool (the compiles then
    have the pool's memory); the pool comes after, and serving compiles nothing more."""
    import jax
    from atlasjax.runner import ModelRunner
    allocate, order = ModelRunner.allocate, []

    def record_allocate(runner, num_pages):
        order.append(("allocate", runner.num_compiles))
        allocate(runner, num_pages)
    monkeypatch.setattr(ModelRunner, "allocate", record_allocate)
    work = _mixed_workload(n=12, seed=7)
    want, _ = _run(_engine(tiny), work)
    engine = _engine(tiny, compile_at_start=True, num_scheduler_steps=2)
    n = engine.runner.num_compiles
    assert order[-1] == ("allocate", n) and n == len(engine.runner._compiled)
    assert sorted(k[1] for k in engine.runner._compiled if k[0] == "decode") == [8] * 8 + [16] * 8   # 4 plans x 2
    shapes = engine.runner._state_shapes(engine.runner.num_pages)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype),
                                                                               engine.runner.state)
    got, _ = _run(engine, work)
    assert got == want
    assert engine.runner.num_compiles == n     # serving compiles nothing more, prompt logprobs included


def test_warmup_before_the_pool_needs_its_size(tiny):
    engine = _engine(tiny)
    engine.runner.state = None
    with pytest.raises(ValueError, match="num_pages"):
        engine.runner.warmup()


def test_warmup_compiles_again_alone_what_ran_out_of_memory_in_threads(tiny, monkeypatch):
    engine = _engine(tiny, max_num_seqs=8)
    runner, compile_ = engine.runner, engine.runner._compile_lowered
    failed = []

    def out_of_memory_once(spec, *args):
        if spec.key[0] == "decode" and not failed:
            failed.append(spec.key)
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1018.00MiB")
        return compile_(spec, *args)
    monkeypatch.setattr(runner, "_compile_lowered", out_of_memory_once)
    runner.warmup(1, threads=2)
    assert failed and failed[0] in runner._compiled     # compiled on the second, lone try

    def broken(spec, *args):
        raise ValueError("a compiler bug")
    monkeypatch.setattr(runner, "_compile_lowered", broken)
    runner._compiled.clear()
    with pytest.raises(ValueError, match="compiler bug"):
        runner.warmup(1, threads=2)


def test_warmup_lowers_in_one_thread_and_compiles_in_many(tiny, monkeypatch):
    """Programs lowered in concurrent threads differed from one start to the next on a GPU, which
    missed the compilation cache on every restart (session 43): the warm-up lowers each step in the
    calling thread, in a fixed order, and only the XLA compiles run in its threads."""
    import threading
    engine = _engine(tiny, max_num_seqs=8)
    runner = engine.runner
    lower, compile_ = runner._lower, runner._compile_lowered
    lowered_in, compiled_in = [], set()

    def record_lower(spec):
        lowered_in.append((threading.current_thread().name, spec.key))
        return lower(spec)

    def record_compile(spec, *args):
        compiled_in.add(threading.current_thread().name)
        return compile_(spec, *args)
    monkeypatch.setattr(runner, "_lower", record_lower)
    monkeypatch.setattr(runner, "_compile_lowered", record_compile)
    runner.warmup(1, threads=2)
    assert {name for name, _ in lowered_in} == {threading.current_thread().name}
    assert compiled_in and all(name.startswith("atlasjax-compile") for name in compiled_in)
    assert len(lowered_in) == runner.num_compiles == len(runner._compiled)


def test_benchmark_warmup_compiles_only_what_greedy_requests_reach(tiny):
    """A benchmark's warm-up (bench throughput) asks for the greedy decodes up to its concurrency and
    the prefill buckets up to its largest prompt step: nothing else compiles (no sampled or logprob
    decodes, no larger prefill, no prompt-logprobs prefill, no admit), and every asked one does."""
    from atlasjax.sampling import SamplingPlan
    runner = _engine(tiny, max_num_seqs=16).runner           # prefill buckets 16, 32, 64; decode 8, 16
    greedy = SamplingPlan(greedy=True, logprobs=False)
    runner.warmup(2, threads=2, plans=(greedy,), max_decode_rows=8, max_prefill_tokens=32)
    assert set(runner._compiled) == {("decode", 8, greedy), ("decode", 8, greedy, 2),
                                     ("prefill", 16, False), ("prefill", 32, False)}

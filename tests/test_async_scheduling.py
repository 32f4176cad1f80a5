"""Asynchronous scheduling (step N+1 dispatched before step N is read back) against the synchronous engine.

The `tiny` bench preset (random weights, word tokenizer "w{i}") gives stop strings and a fast compile.
"""
import dataclasses

import numpy as np
import pytest

from atlasjax import EngineConfigError, SamplingParams
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig


def _engine(loaded, **kw):
    args = dict(max_num_seqs=4, max_model_len=80, page_size=8, max_num_batched_tokens=64)
    return LLMEngine(EngineConfig(**{**args, **kw}), loaded=loaded)


def _mixed_workload(n=16, seed=0):
    """(prompt, params, arrival step): greedy, seeded sampling with filters and penalties, logprobs,
    prompt logprobs, stop strings, stop token ids with min_tokens, n=2."""
    rs = np.random.RandomState(seed)
    kinds = [dict(temperature=0, max_tokens=20),
             dict(temperature=0.9, top_p=0.9, top_k=50, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=25),
             dict(temperature=1.0, logprobs=3, stop=["w7", "w1 w2"], repetition_penalty=1.2, max_tokens=30),
             dict(temperature=1.0, stop_token_ids=list(range(0, 512, 33)), min_tokens=3, prompt_logprobs=2,
                  max_tokens=30),
             dict(n=2, temperature=0.7, max_tokens=15),
             dict(temperature=1.2, stop_token_ids=list(range(3, 512, 35)), max_tokens=40)]
    return [([int(t) for t in rs.randint(0, 512, size=rs.randint(1, 40))],
             SamplingParams(seed=i, **kinds[i % len(kinds)]), int(rs.randint(0, 20))) for i in range(n)]


def _run(engine, work, abort_at=None):
    """Staggered arrivals; returns ({request id: per-sequence results}, {(id, index): [delta dicts]})."""
    pending = sorted(enumerate(work), key=lambda x: x[1][2])
    deltas, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (prompt, params, _) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
        for d in engine.step():
            fields = dataclasses.asdict(d)
            fields.pop("queue_seconds")          # a timing: async and sync admit at other moments
            deltas.setdefault((d.request_id, d.index), []).append(fields)
        step += 1
    results = {rid: [(r.output_token_ids, r.text, r.finish_reason, r.stop_reason, r.logprobs, r.prompt_logprobs)
                     for r in seqs] for rid, seqs in engine.requests.items()}
    for rid in list(engine.requests):
        engine.release(rid)
    engine.pool.reset_prefix_cache()
    assert engine.pool.num_free_pages == engine.pool.num_pages and not engine.scheduler.running
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_num_seqs))
    return results, deltas


def test_async_equals_sync_token_for_token_with_every_sampling_feature(tiny):
    engine = _engine(tiny)
    work = _mixed_workload()
    assert engine.async_scheduling
    on = _run(engine, work)
    engine.async_scheduling = False
    off = _run(engine, work)
    assert on == off                     # outputs, text, finish reasons, logprobs, and every stream delta
    finishes = {r[2] for seqs in on[0].values() for r in seqs}
    stops = {r[3] for seqs in on[0].values() for r in seqs}
    assert finishes == {"stop", "length"} and any(isinstance(s, str) for s in stops)   # the lag was exercised


def test_async_equals_sync_under_preemption_and_aborts(tiny):
    work = _mixed_workload(n=12, seed=1)
    aborts = {6: "r3", 9: "r7"}
    outs = {}
    for mode in (True, False):
        engine = _engine(tiny, num_pages=12, async_scheduling=mode)
        outs[mode] = _run(engine, work, aborts)[0]
        assert engine.scheduler.num_preemptions > 0
    on, off = outs[True], outs[False]
    assert on.keys() == off.keys()
    for rid in on:
        for a, b in zip(on[rid], off[rid]):
            assert a[:4] == b[:4], rid   # tokens, text, finish and stop reasons exactly
            # Logprobs to float rounding: preempted requests recompute their K/V by prefill, and the two
            # modes preempt at different steps (async sees finishes one step later).
            for la, lb in zip(a[4], b[4]):
                assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) < 1e-5 for t in la)


def test_token_after_a_stop_is_dropped_and_the_slot_is_reused_cleanly(tiny):
    engine = _engine(tiny, max_num_seqs=1)       # one slot: the next request takes the finished one's slot
    prompt_a, prompt_b = list(range(1, 12)), list(range(40, 47))
    free = _run(engine, [(prompt_a, SamplingParams(temperature=0, max_tokens=12), 0)])[0]["r0"][0][0]
    k = next(i for i in range(2, 12) if free[i] not in free[:i])
    params_a = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[k]], logprobs=2)
    params_b = SamplingParams(temperature=0.8, seed=3, presence_penalty=1.5, frequency_penalty=1.0, max_tokens=10)
    alone_b = _run(engine, [(prompt_b, params_b, 0)])[0]["r0"][0][0]

    engine.add_request("a", prompt_a, params_a)
    engine.add_request("b", prompt_b, params_b)
    a = engine.requests["a"][0]
    deltas = []
    while not a.is_finished:
        deltas += [d for d in engine.step() if d.request_id == "a"]
    # Step N's token finished `a`, but step N+1 (in flight) was already decoding it: its pages stay
    # until that step completes, its slot is free now.
    assert engine._in_flight is not None and a in engine._in_flight.sample_rows
    assert a.release_pending and a.pages and engine.scheduler.free_slots == [0]
    in_flight = engine._in_flight
    deltas += [d for d in engine.step() if d.request_id == "a"]
    b = engine.requests["b"][0]
    # b took the slot in the step dispatched while N+1 (with a's dropped token) was in flight.
    assert b.slot == 0 and b in engine._in_flight.sample_rows and in_flight is not engine._in_flight
    assert not a.release_pending and not a.pages
    while engine.has_unfinished():
        deltas += [d for d in engine.step() if d.request_id == "a"]
    assert a.output_token_ids == free[:k + 1] and len(a.logprobs) == k + 1 and a.finish_reason == "stop"
    assert sum(len(d.new_token_ids) for d in deltas) == k + 1 and deltas[-1].num_output_tokens == k + 1
    assert engine.requests["b"][0].output_token_ids == alone_b    # its penalty row did not inherit a's counts
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_decode_takes_its_tokens_from_the_device(tiny):
    engine = _engine(tiny)
    host_tokens, decode = [], engine.runner.decode
    engine.runner.decode = lambda tokens, *a, **kw: (host_tokens.append(np.array(tokens)),
                                                     decode(tokens, *a, **kw))[1]
    engine.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6))
    x = engine.requests["x"][0]
    engine.step()                                  # prefill dispatched, nothing read back yet
    assert engine._in_flight is not None and x.output_token_ids == [] and x.num_pending_tokens == 1
    with pytest.raises(RuntimeError, match="in flight"):
        engine.async_scheduling = False
    first = engine.step()                          # decode dispatched with the pending token, then prefill read back
    assert [d.new_token_ids for d in first] == [x.output_token_ids] and x.num_pending_tokens == 1
    assert host_tokens[0][0] == -1                 # x's decode row 0 <- row 0 of the previous step's prefill tokens
    engine.step()
    assert host_tokens[1][0] == -1 - engine.config.max_num_seqs   # <- its row 0 of the previous decode
    while engine.has_unfinished():
        engine.step()
    assert len(x.output_token_ids) == 6 and len(host_tokens) == 5   # the 6th token is the last: no 6th decode
    engine.async_scheduling = False


def test_config_validates_async_scheduling():
    with pytest.raises(EngineConfigError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    assert EngineConfig().async_scheduling is True

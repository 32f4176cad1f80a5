"""Priority scheduling (`scheduling_policy="priority"`, `--scheduling-policy priority`, vLLM's): waiting
requests are admitted by (priority, arrival), lower first; when pages run out the running request that
comes last in that order gives way. Under the default fcfs, a nonzero priority is refused.

The scheduler alone (plain Python), then the engine and the HTTP server on the tiny random Llama with the
server tests' engine settings (so their step programs are shared)."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from atlasjax import LLM, InvalidRequestError, SamplingParams
from atlasjax.engine_config import ALLOW_LONG_MAX_MODEL_LEN, EngineConfig
from atlasjax.errors import EngineConfigError
from atlasjax.page_pool import PagePool
from atlasjax.request import Request
from atlasjax.scheduler import Scheduler
from serving.app import create_app
from tests.server_util import ENGINE_KWARGS, MODEL_NAME, tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)


# ---- the scheduler alone
def _req(rid, n_prompt, priority=0, arrival=0.0, max_tokens=8):
    return Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=max_tokens), 0, max_tokens,
                   arrival_time=arrival, priority=priority)


def _sched(policy, num_pages=16, max_num_seqs=1):
    return Scheduler(PagePool(num_pages, 4, True), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                     policy=policy)


def _admission_order(s, reqs):
    """Ids in the order a one-slot scheduler admits them, each finished once admitted."""
    for r in reqs:
        s.add(r)
    order = []
    while s.waiting:
        (admitted,) = s.schedule().admitted
        order.append(admitted.request_id)
        s.finish(admitted, "stop")
    return order


def test_priority_admits_lower_values_first_then_by_arrival():
    reqs = [_req("a", 3, priority=2, arrival=1), _req("b", 3, priority=0, arrival=2),
            _req("c", 3, priority=2, arrival=0.5), _req("d", 3, priority=-1, arrival=3),
            _req("e", 3, priority=0, arrival=1.5)]
    assert _admission_order(_sched("priority"), reqs) == ["d", "e", "b", "c", "a"]


def test_fcfs_ignores_priority_order_and_keeps_arrival_order():
    reqs = [_req("a", 3, priority=2, arrival=1), _req("b", 3, priority=0, arrival=2), _req("c", 3, arrival=0.5)]
    assert _admission_order(_sched("fcfs"), reqs) == ["a", "b", "c"]    # the order they were added


def _two_running_then_out_of_pages(policy, first_priority):
    """a (admitted first) and b both decode with full pages and none free: one must give way."""
    s = _sched(policy, num_pages=4, max_num_seqs=2)
    a, b = _req("a", 7, priority=first_priority, arrival=1), _req("b", 7, priority=0, arrival=2)
    s.add(a)
    s.schedule()
    s.add(b)
    s.schedule()
    for r in (a, b):
        r.output_token_ids += [1, 1]
        r.num_computed_tokens = 8
    return s, a, b, s.schedule()


def test_priority_preempts_the_lowest_priority_even_when_it_came_first():
    s, a, b, out = _two_running_then_out_of_pages("priority", first_priority=5)
    assert out.preempted == [a] and out.decodes == [b] and s.waiting[0] is a


def test_priority_preempts_the_newest_among_equals_as_fcfs_does():
    for policy in ("priority", "fcfs"):
        s, a, b, out = _two_running_then_out_of_pages(policy, first_priority=0)
        assert out.preempted == [b] and out.decodes == [a], policy


def test_a_preempted_request_goes_back_to_its_place_in_priority_order():
    s = _sched("priority", max_num_seqs=2)
    low, mid = _req("low", 3, priority=9, arrival=1), _req("mid", 3, priority=3, arrival=2)
    s.add(low)
    s.add(mid)
    s.schedule()
    s.add(_req("top", 3, priority=0, arrival=3))
    s.add(_req("next", 3, priority=5, arrival=4))
    s.preempt(low)
    assert [r.request_id for r in s.waiting] == ["top", "next", "low"]
    s.preempt(mid)
    assert [r.request_id for r in s.waiting] == ["top", "mid", "next", "low"]


def test_an_unknown_policy_is_a_config_error():
    with pytest.raises(EngineConfigError, match="scheduling_policy must be one of fcfs, priority"):
        EngineConfig(scheduling_policy="lifo")


# ---- the engine
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def priority_llm(model_dir):
    return LLM(model_dir, **ENGINE_KWARGS, scheduling_policy="priority")


@pytest.fixture(scope="module")
def fcfs_llm(model_dir):
    return LLM(model_dir, **ENGINE_KWARGS)


def _prompts(n):
    return [[(37 * i + 11 * j) % 500 + 1 for j in range(5 + i % 7)] for i in range(n)]


def _first_token_steps(engine, prompts, priorities, max_tokens=6):
    """Run every request together; the step at which each got its first token."""
    for i, (prompt, rank) in enumerate(zip(prompts, priorities)):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), priority=rank)
    first, step = {}, 0
    while engine.has_unfinished():
        engine.step()
        step += 1
        for i in range(len(prompts)):
            if f"p{i}" not in first and engine.requests[f"p{i}"][0].output_token_ids:
                first[f"p{i}"] = step
    outs = [engine.requests[f"p{i}"][0].output_token_ids for i in range(len(prompts))]
    for i in range(len(prompts)):
        engine.release(f"p{i}")
    return [first[f"p{i}"] for i in range(len(prompts))], outs


def test_more_requests_than_slots_are_served_in_priority_order_with_the_same_tokens(priority_llm, fcfs_llm):
    engine = priority_llm.engine
    n = engine.config.max_num_seqs + 4
    prompts = _prompts(n)
    priorities = [(5 * i) % 7 - 3 for i in range(n)]     # -3..3, shuffled, with ties
    steps, outs = _first_token_steps(engine, prompts, priorities)
    order = sorted(range(n), key=lambda i: (priorities[i], i))   # (priority, arrival)
    slots = engine.config.max_num_seqs
    first_wave, rest = order[:slots], order[slots:]
    # the highest priorities hold every slot first; the rest start later, in their order
    assert max(steps[i] for i in first_wave) < min(steps[i] for i in rest)
    assert [steps[i] for i in rest] == sorted(steps[i] for i in rest)
    # priority moves requests in time, never their tokens
    alone = fcfs_llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    assert outs == [o.outputs[0].token_ids for o in alone]
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_out_of_pages_the_lower_priority_request_gives_way(model_dir, fcfs_llm):
    prompt_a, prompt_b = _prompts(2)
    params = SamplingParams(max_tokens=60, **GREEDY)
    # each needs up to 5 pages of 16 tokens; 7 hold both prompts but not both answers
    tight = dict(ENGINE_KWARGS, num_pages=7, max_model_len=112)
    preempted = {}
    for policy, rank_a in (("fcfs", 0), ("priority", 5)):
        engine = LLM(model_dir, **tight, scheduling_policy=policy).engine
        engine.add_request("a", prompt_a, params, priority=rank_a)    # a arrives first, and runs first
        engine.step()
        engine.add_request("b", prompt_b, params)
        while engine.has_unfinished():
            engine.step()
        preempted[policy] = {r: engine.requests[r][0].num_preemptions > 0 for r in "ab"}
        outs = [engine.requests[r][0].output_token_ids for r in "ab"]
        assert outs == [o.outputs[0].token_ids for o in fcfs_llm.generate([prompt_a, prompt_b], params)], policy
        for r in "ab":
            engine.release(r)
        assert engine.pool.num_free_pages == engine.pool.num_pages
    assert preempted == {"fcfs": {"a": False, "b": True}, "priority": {"a": True, "b": False}}


def test_priority_needs_the_priority_policy_and_an_integer(fcfs_llm, priority_llm):
    with pytest.raises(InvalidRequestError, match="needs the priority scheduling policy"):
        fcfs_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), priority=[1])
    assert fcfs_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), priority=[0])[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="priority must be an integer"):
        priority_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), priority=[1.5])
    with pytest.raises(InvalidRequestError, match="got 1 priorities for 2 prompts"):
        priority_llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2), priority=[1])
    for llm in (fcfs_llm, priority_llm):     # nothing stays queued after a refusal
        assert not llm.engine.has_unfinished() and llm.engine.pool.num_free_pages == llm.engine.pool.num_pages


# ---- the HTTP server (in process)
@pytest.fixture(scope="module")
def async_engines(model_dir):
    """One slot each, and room for a request that holds it far longer than the test needs (past the tiny
    model's 1,024 positions: what it generates there does not matter)."""
    from atlasjax.async_llm import AsyncLLM
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ALLOW_LONG_MAX_MODEL_LEN, "1")
        engines = {policy: AsyncLLM(model_dir, **dict(ENGINE_KWARGS, max_num_seqs=1, max_model_len=2048),
                                    scheduling_policy=policy) for policy in ("fcfs", "priority")}
    yield engines
    for e in engines.values():
        e.shutdown(drain=False)


def _serve(engine, fn):
    app = create_app(engine, served_model_name=MODEL_NAME)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            return await fn(client)
    return asyncio.run(go())


def test_server_refuses_priority_without_the_priority_policy(async_engines):
    async def fn(client):
        body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0}
        bad = await client.post("/v1/completions", json={**body, "prompt": "Hi", "priority": 3})
        chat = await client.post("/v1/chat/completions",
                                 json={**body, "messages": [{"role": "user", "content": "Hi"}], "priority": -1})
        zero = await client.post("/v1/completions", json={**body, "prompt": "Hi", "priority": 0})
        return bad, chat, zero
    bad, chat, zero = _serve(async_engines["fcfs"], fn)
    for r in (bad, chat):
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
    assert zero.status_code == 200


def test_server_admits_the_higher_priority_request_first(async_engines):
    """One slot, held by a long request; two more wait (priority 5, then -1). When the first is dropped,
    the -1 request runs before the 5 one, though it arrived later."""
    engine = async_engines["priority"]
    body = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True, "max_tokens": 4}

    async def fn(client):
        finished = []

        async def post(name, priority):
            r = await client.post("/v1/completions", json={**body, "prompt": name, "priority": priority})
            finished.append(name)
            return r
        held = engine.generate([1, 2, 3], SamplingParams(max_tokens=2000, **GREEDY), "hold")
        await anext(held)                                  # it has the slot
        low = asyncio.create_task(post("low", 5))
        await _until(lambda: len(engine.engine.scheduler.waiting) == 1)
        high = asyncio.create_task(post("high", -1))
        await _until(lambda: len(engine.engine.scheduler.waiting) == 2)
        assert not engine.engine.requests["hold"][0].is_finished   # (else the test proves nothing)
        await held.aclose()                                # aborted: its slot is free
        responses = await asyncio.gather(low, high)
        return finished, responses, (await client.get("/metrics")).text
    finished, responses, metrics = _serve(engine, fn)
    assert all(r.status_code == 200 for r in responses)
    assert finished == ["high", "low"]
    assert engine.engine.pool.num_free_pages == engine.engine.pool.num_pages
    # /metrics: both HTTP requests waited in the queue, then ran to their length
    assert _sample(metrics, "atlasjax_request_queue_time_seconds_count") == 2
    assert _sample(metrics, "atlasjax_request_queue_time_seconds_sum") > 0
    assert _sample(metrics, 'atlasjax_requests_finished_total{finished_reason="length"}') == 2
    assert _sample(metrics, "atlasjax_e2e_request_latency_seconds_count") == 2


def _sample(text: str, series: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(series + " ")]
    return float(line.rsplit(" ", 1)[1])


async def _until(condition, timeout=60.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def test_the_cli_flag_reaches_the_engine_config():
    from atlasjax.__main__ import build_parser, engine_kwargs
    parse = build_parser().parse_args
    assert engine_kwargs(parse(["serve", "--scheduling-policy", "priority"]))["scheduling_policy"] == "priority"
    assert engine_kwargs(parse(["generate", "hi"]))["scheduling_policy"] == "fcfs"
    with pytest.raises(SystemExit):
        parse(["serve", "--scheduling-policy", "lifo"])

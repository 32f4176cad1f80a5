"""Data parallelism (atlasjax/data_parallel.py, `serve --data-parallel-size N`).

Without engines: each replica gets its own GPUs (or a clear error when too few are visible), the router sends
a prompt to the replica that served its prefix unless that one is much busier, else spreads load, and the
replicas' stats sum. With two engine processes on the tiny Llama 3 of tests/server_util.py: greedy answers
equal the in-process engine's while both replicas serve, a conversation's next turn hits its replica's prefix
cache, a stream left early frees its pages, sleep and wake-up reach both, embeddings come back from one, and a
dead replica fails its own streams while the other serves on. Through a live server: the same completions,
per-replica series on /metrics, and a clean drain.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.data_parallel import (AFFINITY_SLACK, DataParallelLLM, PrefixRouter, combine_stats,
                                    replica_environments, visible_gpus)
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError, InvalidRequestError, UnsupportedModelError
from atlasjax.metrics import EngineStats
from atlasjax.speculative import SpecStats
from tests.server_util import (API_KEY, ENGINE_KWARGS, MODEL_NAME, greedy_reference, make_tiny_model, metric_value,
                               reference_llm, shared_server, tiny_model_dir)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PAGE = ENGINE_KWARGS.get("page_size", 16)


# ---- without engines

def test_each_replica_gets_its_own_gpus():
    assert replica_environments(2, 2, ["0", "1", "2", "3"]) == [{"CUDA_VISIBLE_DEVICES": "0,1"},
                                                                 {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert replica_environments(2, 1, ["3", "5", "7"]) == [{"CUDA_VISIBLE_DEVICES": "3"},
                                                           {"CUDA_VISIBLE_DEVICES": "5"}]
    assert replica_environments(3, 4, None) == [{}, {}, {}]     # CPU: each process has its own devices
    with pytest.raises(EngineConfigError, match="needs 4 GPUs; 2 visible"):
        replica_environments(2, 2, ["0", "1"])


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) is None


def test_the_router_spreads_distinct_prompts_and_keeps_prefixes_together():
    router = PrefixRouter(2, page_size=4)
    a, b = list(range(100, 112)), list(range(200, 212))
    assert router.route(a, [0, 0]) == 0
    assert router.route(b, [1, 0]) == 1                 # the least loaded
    assert router.route(a + [7, 8, 9, 10], [1, 1]) == 0   # its first three pages were replica 0's
    assert router.route(b[:8] + [1, 2, 3, 4], [0, 0]) == 1   # two pages in common are enough
    assert router.route([5, 6, 7], [0, 0]) in (0, 1)    # shorter than a page: by load alone
    # a busy owner loses its prefixes to the least loaded, then owns them no more
    assert router.route(a, [AFFINITY_SLACK + 1, 0]) == 1
    assert router.route(a, [0, 0]) == 1
    assert router.route(a, [2, None]) == 0              # a dead replica takes nothing
    router.forget()
    assert router.route(b, [1, 0]) == 1
    with pytest.raises(RuntimeError, match="every data-parallel replica"):
        router.route(a, [None, None])


def test_least_loaded_routing_ignores_prefixes():
    router = PrefixRouter(2, page_size=4, affinity=False)
    a = list(range(100, 112))
    assert [router.route(a, [0, 0]) for _ in range(3)] == [0, 1, 0]
    assert router.route(a, [3, 1]) == 1
    with pytest.raises(EngineConfigError, match="routing must be one of prefix, least-loaded"):
        DataParallelLLM(EngineConfig(model="unused"), 2, routing="random")


def test_equal_loads_take_turns():
    router = PrefixRouter(3, page_size=4)
    assert [router.route(None, [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]


def test_replica_stats_are_summed():
    one = EngineStats(num_requests=3, generation_tokens=10, pages_free=5, pages_total=8, num_running=1,
                      last_step_seconds=0.01, running_lora_adapters=("a",),
                      spec=SpecStats(1, 2, 1, [1, 0]))
    two = EngineStats(num_requests=1, generation_tokens=4, pages_free=8, pages_total=8, num_waiting=2,
                      last_step_seconds=0.03, running_lora_adapters=("b", "a"),
                      spec=SpecStats(2, 6, 3, [2, 1, 0]))
    total = combine_stats([one, two])
    assert (total.num_requests, total.generation_tokens, total.num_running, total.num_waiting) == (4, 14, 1, 2)
    assert total.kv_cache_usage == pytest.approx(3 / 16)
    assert total.last_step_seconds == 0.03 and total.running_lora_adapters == ("a", "b")
    assert (total.spec.num_draft_tokens, total.spec.accepted_per_pos) == (8, [3, 1, 0])


def test_the_flag_takes_positive_sizes_and_refuses_multi_host():
    from atlasjax.__main__ import _start_distributed, build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--data-parallel-size", "0"])
    args = build_parser().parse_args(["serve", "-dp", "2", "--num-processes", "2", "--process-id", "0",
                                      "--coordinator-address", "127.0.0.1:1"])
    assert isinstance(args, argparse.Namespace) and args.data_parallel_size == 2
    with pytest.raises(EngineConfigError, match="data-parallel-size runs its replicas on one host"):
        _start_distributed(args)


# ---- two engine processes

@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    gpus = visible_gpus()
    if gpus is not None and len(gpus) < 2:
        pytest.skip(f"two replicas need two GPUs; {len(gpus)} visible")
    llm = DataParallelLLM(EngineConfig(model=tiny_model_dir(tmp_path_factory), **ENGINE_KWARGS), 2)
    yield llm
    llm.shutdown(timeout=30)


async def _tokens(llm, prompt, params=GREEDY) -> list[int]:
    return [t async for d in llm.generate(prompt, params) for t in d.new_token_ids]


def _wait_idle(llm, timeout=30.0) -> list[EngineStats]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        stats = llm.replica_stats
        if all(s.num_running == s.num_waiting == 0 and s.pages_free == s.pages_total for s in stats):
            break
        time.sleep(0.05)
    return llm.replica_stats


def test_two_replicas_answer_as_one_engine_and_share_the_load(dp, tmp_path_factory):
    prompts = [[128000, *range(1000 + 50 * i, 1000 + 50 * i + 20)] for i in range(4)]
    want = [o.outputs[0].token_ids for o in greedy_reference(reference_llm(tmp_path_factory), prompts, 6)]

    async def all_at_once():
        return await asyncio.gather(*(_tokens(dp, p) for p in prompts))
    assert asyncio.run(all_at_once()) == [list(w) for w in want]
    served = [s.num_requests for s in _wait_idle(dp)]
    assert min(served) >= 1 and sum(served) >= 4, served
    assert dp.stats.num_requests == sum(served)


def test_a_conversations_next_turn_hits_its_replicas_prefix_cache(dp):
    turn = [128000, *range(3000, 3000 + 3 * PAGE)]
    answer = asyncio.run(_tokens(dp, turn))
    before = [s.prefix_cache_hits for s in _wait_idle(dp)]
    # the same replica, though the router's turn has moved on: the other one would compute it all again
    asyncio.run(_tokens(dp, turn + answer + list(range(4000, 4010))))
    gained = [s.prefix_cache_hits - b for s, b in zip(_wait_idle(dp), before)]
    assert sorted(gained) == [0, 3], gained


def test_a_stream_left_early_frees_its_pages(dp):
    async def leave():
        gen = dp.generate([128000, *range(5000, 5040)], SamplingParams(max_tokens=100, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()
    asyncio.run(leave())
    assert all(s.num_running == 0 and s.pages_free == s.pages_total for s in _wait_idle(dp))


def test_sleep_and_wake_up_reach_every_replica(dp):
    prompt = [128000, *range(7000, 7020)]
    before = asyncio.run(_tokens(dp, prompt))

    async def cycle():
        await dp.sleep(1)
        asleep = await dp.is_sleeping()
        await dp.wake_up()
        return asleep, await dp.is_sleeping(), [await r.is_sleeping() for r in dp.replicas]
    assert asyncio.run(cycle()) == (True, False, [False, False])
    assert [asyncio.run(_tokens(dp, prompt)) for _ in range(2)] == [before, before]   # on both replicas


def test_pauses_and_new_weights_reach_every_replica(dp, tmp_path_factory):
    first = tiny_model_dir(tmp_path_factory)
    second = make_tiny_model(str(tmp_path_factory.mktemp("tiny_llama3_second")), seed=1)
    prompt = [128000, *range(8000, 8020)]
    want = [o.outputs[0].token_ids for o in greedy_reference(LLM(second, **ENGINE_KWARGS), [prompt], 6)][0]
    before = asyncio.run(_tokens(dp, prompt))

    async def cycle():
        await dp.pause_generation("keep")
        paused = await dp.is_paused(), [await r.is_paused() for r in dp.replicas]
        loaded = await dp.update_weights_from_disk(second)
        await dp.resume_generation()
        return paused, loaded["seconds"] > 0, await dp.is_paused()
    assert asyncio.run(cycle()) == ((True, [True, True]), True, False)
    assert [asyncio.run(_tokens(dp, prompt)) for _ in range(2)] == [list(want)] * 2   # on both replicas
    asyncio.run(dp.update_weights_from_disk(first))
    assert asyncio.run(_tokens(dp, prompt)) == before


def test_embeddings_come_from_a_replica(dp, tmp_path_factory):
    texts = ["Hello there", "Count: 1 2 3"]
    want = [o.outputs.embedding for o in reference_llm(tmp_path_factory).embed(texts)]
    ids = [dp.tokenizer.encode(t) for t in texts]
    got = asyncio.run(dp.embed(ids, None))
    assert [list(tokens) for tokens, _ in got] == ids
    for (_, vector), expected in zip(got, want):
        assert list(vector) == pytest.approx(expected, abs=1e-5)


def test_an_open_request_id_is_refused(dp):
    async def twice():
        first = dp.generate([128000, 1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), "same-id")
        await first.__anext__()
        try:
            with pytest.raises(InvalidRequestError, match="already in use"):
                await _tokens_with_id(dp, "same-id")
        finally:
            await first.aclose()
        return await _tokens_with_id(dp, "same-id")    # free again once the first has ended
    assert len(asyncio.run(twice())) == GREEDY.max_tokens


async def _tokens_with_id(llm, request_id) -> list[int]:
    return [t async for d in llm.generate([128000, 5, 6, 7], GREEDY, request_id) for t in d.new_token_ids]


def test_a_dead_replica_fails_its_own_streams_and_the_other_serves_on(dp, tmp_path_factory):
    """(Last of the module: it kills one of the fixture's replicas.)"""
    prompt = [128000, *range(6000, 6020)]
    want = list(greedy_reference(reference_llm(tmp_path_factory), [prompt], 6)[0].outputs[0].token_ids)
    dp.replicas[1]._process.kill()
    end = time.monotonic() + 30
    while dp.is_healthy and time.monotonic() < end:
        time.sleep(0.05)
    assert not dp.is_healthy and "data-parallel replica 1" in str(dp.error)
    assert [asyncio.run(_tokens(dp, prompt)) for _ in range(3)] == [want] * 3   # all on replica 0


def test_a_bad_model_fails_the_start_with_the_engines_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}')
    with pytest.raises(UnsupportedModelError, match="NoSuchForCausalLM"):
        DataParallelLLM(EngineConfig(model=str(tmp_path), **ENGINE_KWARGS), 2, gpus=None)


def fail_on_the_second_gpu() -> None:
    """An engine process's setup (tests below): note this process's pid, then fail where given GPU "1"."""
    import os
    gpu = os.environ["CUDA_VISIBLE_DEVICES"]
    with open(os.path.join(os.environ["ATLASJAX_TEST_DP_DIR"], gpu), "w") as f:
        f.write(str(os.getpid()))
    if gpu == "1":
        raise EngineConfigError("replica on GPU 1 refused to start")


def test_a_replica_that_fails_to_start_stops_the_others(tmp_path, tmp_path_factory, monkeypatch):
    """(On CPU the CUDA_VISIBLE_DEVICES given to each replica only tells them apart.)"""
    import os
    monkeypatch.setenv("ATLASJAX_TEST_DP_DIR", str(tmp_path))
    with pytest.raises(EngineConfigError, match="replica on GPU 1 refused"):
        DataParallelLLM(EngineConfig(model=tiny_model_dir(tmp_path_factory), **ENGINE_KWARGS), 2,
                        setup=fail_on_the_second_gpu, gpus=["0", "1"])
    started = int((tmp_path / "0").read_text())
    with pytest.raises(ProcessLookupError):     # stopped and reaped
        os.kill(started, 0)


# ---- a live server

def test_a_server_with_two_replicas_answers_as_one_and_reports_each(request, tmp_path_factory):
    if (gpus := visible_gpus()) is not None and len(gpus) < 2:
        pytest.skip(f"two replicas need two GPUs; {len(gpus)} visible")
    server = shared_server(request, tmp_path_factory, "data_parallel", "--api-key", API_KEY, "-dp", "2")
    prompts = ["Hello there", "Count: 1 2 3", "The sky is", "Once upon"]
    ref = greedy_reference(reference_llm(tmp_path_factory), prompts, 6)
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": p, "max_tokens": 6, "temperature": 0}) for p in prompts))
    bodies = [r.json() for r in asyncio.run(all_at_once())]
    assert [b["choices"][0]["text"] for b in bodies] == [r.outputs[0].text for r in ref]
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
        health = http.get("/health").json()
        metrics = http.get("/metrics").text
        assert http.get("/get_server_info").json()["dp_size"] == 2
        sglang = http.post("/generate", json={"text": prompts[0], "sampling_params": {
            "temperature": 0, "max_new_tokens": 6}}).json()                  # SGLang's route through the router
        assert sglang["text"] == ref[0].outputs[0].text
    assert health["status"] == "ok"
    assert [r["status"] for r in health["replicas"]] == ["ok", "ok"]
    assert sum(r["kv_pages_total"] for r in health["replicas"]) == health["kv_pages_total"]
    per_replica = [metric_value(metrics, f'atlasjax_engine_generation_tokens_total{{engine="{r}"}}') for r in (0, 1)]
    assert min(per_replica) > 0 and sum(per_replica) >= 4 * 6, per_replica
    assert metric_value(metrics, "atlasjax_kv_pages_total") == health["kv_pages_total"]
    assert health["kv_pages_total"] % 2 == 0          # two equal pools
    assert server.stop(timeout=60) == 0
    assert "atlasjax: server stopped" in server.log() and "Traceback" not in server.log()

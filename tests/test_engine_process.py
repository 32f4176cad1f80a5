"""The engine in a process of its own (atlasjax/engine_process.py, `serve --engine-process`).

Through the Python API on the embedded default model: the same greedy text as the in-process engine
(also at TP=3), request errors raised to the caller with the engine still serving, a stream left
early gives its pages back, a bad model fails the start with the engine's own error, and a child
that dies fails its streams and reports unhealthy. Through a live server (the tiny Llama 3 of tests/server_util.py):
the same completions as in-process, /health and /metrics from the child's stats, and a clean drain
on SIGTERM.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from atlasjax import LLM, BeamSearchParams, SamplingParams
from atlasjax.engine_config import EngineConfig
from atlasjax.engine_process import EngineProcessLLM
from atlasjax.errors import InvalidRequestError, QueueFullError
from tests.server_util import (API_KEY, MODEL_NAME, engine_process_server, greedy_reference, metric_value,
                               reference_llm)

ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = ["The capital of France is", "One, two, three,"]


@pytest.fixture(scope="module")
def model(default_model_path):
    return default_model_path


@pytest.fixture(scope="module")
def llm(model):
    llm = EngineProcessLLM(EngineConfig(model=model, **ENGINE))
    yield llm
    llm.shutdown(timeout=30)


async def _text(llm, prompt, params=GREEDY) -> str:
    return "".join([d.new_text async for d in llm.generate(prompt, params)])


def _wait_idle(llm, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        stats = llm.stats
        if stats.num_running == stats.num_waiting == 0 and stats.pages_free == stats.pages_total:
            return stats
        time.sleep(0.05)
    return llm.stats


def test_answers_as_the_engine_in_this_process(llm, model):
    want = [o.outputs[0].text for o in LLM(model, **ENGINE).generate(PROMPTS, GREEDY)]

    async def both():
        return await asyncio.gather(*(_text(llm, p) for p in PROMPTS))
    assert asyncio.run(both()) == want
    assert "Paris" in want[0]
    assert llm.engine.max_model_len == 128 and llm.tokenizer.encode("Paris", False)
    stats = _wait_idle(llm)
    assert stats.num_finished >= 2 and stats.generation_tokens >= 16


def test_a_bad_request_is_raised_and_the_engine_serves_on(llm):
    async def run():
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await _text(llm, list(range(1, 200)))
        return await _text(llm, PROMPTS[0])
    assert "Paris" in asyncio.run(run())
    assert llm.is_healthy
    stats = _wait_idle(llm)
    assert stats.pages_free == stats.pages_total


def test_a_stream_left_early_gives_its_pages_back(llm):
    async def run():
        gen = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()
    aborted = llm.stats.num_aborted
    asyncio.run(run())
    stats = _wait_idle(llm)
    assert stats.num_running == 0 and stats.pages_free == stats.pages_total
    assert stats.num_aborted == aborted + 1


def test_a_full_queue_is_refused(model):
    llm = EngineProcessLLM(EngineConfig(model=model, **ENGINE), max_waiting=0)
    try:
        with pytest.raises(QueueFullError):
            asyncio.run(_text(llm, PROMPTS[0]))
        assert llm.is_healthy
    finally:
        llm.shutdown(timeout=30)


def test_a_bad_model_fails_the_start_with_the_engines_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}')
    try:
        LLM(str(tmp_path), **ENGINE)
    except Exception as e:  # noqa: BLE001 (what the in-process engine raises, whatever it is)
        want = e
    with pytest.raises(type(want), match=str(want)[:40].replace("(", r"\(").replace("[", r"\[")):
        EngineProcessLLM(EngineConfig(model=str(tmp_path), **ENGINE))


def test_a_dead_engine_process_fails_its_streams_and_reports_unhealthy(model):
    llm = EngineProcessLLM(EngineConfig(model=model, **ENGINE))

    async def run():
        gen = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        await gen.__anext__()
        llm._process.kill()
        with pytest.raises(RuntimeError, match="engine process exited"):
            async for _ in gen:
                pass
        with pytest.raises(RuntimeError, match="engine failed"):
            await _text(llm, PROMPTS[0])
    try:
        asyncio.run(run())
        assert not llm.is_healthy
    finally:
        llm.shutdown(timeout=5)


def test_a_tensor_parallel_engine_process_answers_as_one_device(model):
    """The child sees the devices the server's process would (tests/conftest.py: 8 CPU devices)."""
    want = [o.outputs[0].text for o in LLM(model, **ENGINE).generate(PROMPTS, GREEDY)]
    llm = EngineProcessLLM(EngineConfig(model=model, tensor_parallel_size=3, **ENGINE))   # SmolLM2: 9 heads, 3 KV heads
    try:
        assert [asyncio.run(_text(llm, p)) for p in PROMPTS] == want
    finally:
        llm.shutdown(timeout=30)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return engine_process_server(request, tmp_path_factory)


def test_log_requests_logs_each_request_without_its_text(server):
    """`serve --log-requests` (here with the engine in its own process: the server process logs): one line
    when a request is submitted (prompt length, the settings it changed) and one per finished sequence."""
    prompt = "Secret words: blue giraffe"
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "log-1"}
    r = httpx.post(server.url + "/v1/completions", headers=headers,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "n": 2, "temperature": 0.5,
                         "seed": 1, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200
    lines = [line for line in server.log().splitlines() if "request cmpl-log-1-" in line]
    assert len(lines) == 3, server.log()[-2000:]
    assert f"{r.json()['usage']['prompt_tokens']} prompt tokens" in lines[0]
    assert "n=2" in lines[0] and "temperature=0.5" in lines[0] and "max_tokens=3" in lines[0]
    assert all("length after 3 tokens" in line for line in lines[1:])
    assert "giraffe" not in server.log()


def test_the_server_logs_stats_lines_with_the_tokens_it_generated(server):
    """`serve --log-stats-interval` (0.5 s here): a stats line counts the tokens the engine process made."""
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL_NAME, "prompt": "Count with me", "max_tokens": 8, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in server.log().splitlines() if "generation throughput" in line]
        if any("generation throughput 0.0 " not in line for line in lines):
            return
        time.sleep(0.2)
    raise AssertionError(f"no stats line with generated tokens:\n{server.log()[-2000:]}")


def test_a_server_with_an_engine_process_answers_as_in_process(server, tmp_path_factory):
    ref = greedy_reference(reference_llm(tmp_path_factory), ["Hello there", "Count: 1 2 3"], 6)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
        for r in ref:
            body = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": r.prompt, "max_tokens": 6,
                                                       "temperature": 0}).json()
            assert body["choices"][0]["text"] == r.outputs[0].text
            assert body["usage"]["prompt_tokens"] == len(r.prompt_token_ids)
        # beam search runs its rounds as requests through the engine process, its end tokens known here
        beams = reference_llm(tmp_path_factory).beam_search(ref[0].prompt, BeamSearchParams(beam_width=2, max_tokens=3))
        body = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ref[0].prompt, "max_tokens": 3,
                                                   "n": 2, "use_beam_search": True}).json()
        assert [c["text"] for c in body["choices"]] == [s.text for s in beams[0].sequences]
        # embeddings run in the engine process and come back through the pipe
        want = reference_llm(tmp_path_factory).embed(["Hello there"])[0].outputs.embedding
        body = http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "Hello there"}).json()
        assert body["data"][0]["embedding"] == pytest.approx(want, abs=1e-5)
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["kv_pages_free"] == health["kv_pages_total"] > 0
        metrics = http.get("/metrics").text
        assert metric_value(metrics, "atlasjax_kv_pages_total") == health["kv_pages_total"]
        assert metric_value(metrics, "atlasjax_engine_steps_total") > 0


def test_a_server_with_an_engine_process_drains_on_sigterm(server):
    body = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.terminate()   # SIGTERM: the engine process ignores it; the server drains it, then stops it
        rest = list(lines)
    assert "data: [DONE]" in rest
    assert sum('"finish_reason": "length"' in line for line in rest) == 1
    assert server.stop(timeout=60) == 0
    assert "atlasjax: server stopped" in server.log() and "Traceback" not in server.log()

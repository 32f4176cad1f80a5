"""The routes an RL loop drives a live server with between rollouts (`serve --enable-weight-updates`,
serving/weight_routes.py), in-process and with the engine in a process of its own: a request arriving during a
pause waits and completes after /resume, an "abort" pause ends the requests it finds with finish_reason "abort",
/update_weights_from_disk makes the server answer as one started on the new checkpoint (the weight version
reported), and a checkpoint it cannot load is a 400 with the old weights serving on. Without the flag the routes
do not exist."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from atlasjax import LLM
from tests.server_util import (API_KEY, ENGINE_KWARGS, MODEL_NAME, ServerProcess, greedy_reference, main_server,
                               make_tiny_model, reference_llm, tiny_model_dir)

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_llama3_second")), seed=1)


@pytest.fixture(scope="module", params=["thread", "engine-process"])
def server(request, tmp_path_factory):
    extra = ["--enable-weight-updates"] + (["--engine-process"] if request.param == "engine-process" else [])
    log_path = str(tmp_path_factory.mktemp(f"weights_{request.param}") / "server.log")
    server = ServerProcess(tiny_model_dir(tmp_path_factory), log_path, *extra)
    yield server
    server.stop()


def _complete(server, prompt=PROMPT, max_tokens=MAX_TOKENS) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _post(server, path, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kwargs)


def _is_paused(server) -> bool:
    return httpx.get(server.url + "/is_paused", timeout=30).json()["is_paused"]


def test_a_request_during_a_pause_waits_for_resume(server, tmp_path_factory):
    want = greedy_reference(reference_llm(tmp_path_factory), [PROMPT], MAX_TOKENS)[0].outputs[0].text
    assert _post(server, "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert _is_paused(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_complete, server)
        time.sleep(1.0)
        assert not pending.done()
        assert _post(server, "/resume").json() == {"status": "resumed"}
        assert pending.result(timeout=60)["text"] == want
    assert not _is_paused(server)


def test_an_abort_pause_ends_the_requests_it_finds(server):
    _post(server, "/pause_generation", json={"mode": "in_place"})        # SGLang's names
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_complete, server)
        time.sleep(1.0)
        assert _post(server, "/pause", params={"mode": "abort"}).status_code == 200
        assert pending.result(timeout=60)["finish_reason"] == "abort"
    assert _post(server, "/continue_generation").status_code == 200
    assert not _is_paused(server)
    health = httpx.get(server.url + "/health", timeout=30).json()
    assert health["kv_pages_free"] == health["kv_pages_total"]       # nothing leaked


def test_new_weights_from_disk_and_a_checkpoint_it_cannot_load(server, second_dir, tmp_path_factory):
    first = tiny_model_dir(tmp_path_factory)
    want_second = greedy_reference(LLM(second_dir, **ENGINE_KWARGS), [PROMPT], MAX_TOKENS)[0].outputs[0].text
    want_first = greedy_reference(reference_llm(tmp_path_factory), [PROMPT], MAX_TOKENS)[0].outputs[0].text
    assert want_first != want_second
    r = _post(server, "/update_weights_from_disk", json={"model_path": second_dir, "weight_version": "step-1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert _complete(server)["text"] == want_second
    assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": "step-1"}
    r = _post(server, "/update_weights_from_disk", json={"model_path": second_dir + "-missing"})
    assert r.status_code == 400 and not r.json()["success"] and "missing" in r.json()["message"]
    assert _complete(server)["text"] == want_second                    # the weights it had serve on
    assert not _is_paused(server)
    r = _post(server, "/update_weights_from_disk", json={"model_path": first, "abort_all_requests": True})
    assert r.status_code == 200 and r.json()["weight_version"] == "step-1"
    assert _complete(server)["text"] == want_first


def test_an_update_lets_the_requests_in_flight_finish_on_the_old_weights(server, second_dir, tmp_path_factory):
    """Without a pause, /update_weights_from_disk waits for the requests in flight (SGLang's default): one running
    when it comes ends as the old weights make it, whole; the next answers as the new weights do."""
    first = tiny_model_dir(tmp_path_factory)
    long = 96
    want_old = greedy_reference(reference_llm(tmp_path_factory), [PROMPT], long)[0].outputs[0].text
    want_new = greedy_reference(LLM(second_dir, **ENGINE_KWARGS), [PROMPT], MAX_TOKENS)[0].outputs[0].text
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_complete, server, PROMPT, long)
        time.sleep(0.3)
        r = _post(server, "/update_weights_from_disk", json={"model_path": second_dir})
        assert r.status_code == 200 and r.json()["success"], r.text
        finished = pending.result(timeout=60)
    assert finished["text"] == want_old and finished["finish_reason"] == "length"
    assert _complete(server)["text"] == want_new
    assert _post(server, "/update_weights_from_disk", json={"model_path": first}).status_code == 200


def test_bad_pause_requests_are_refused(server):
    assert _post(server, "/pause", params={"mode": "freeze"}).status_code == 400
    assert _post(server, "/pause", params={"clear_cache": "maybe"}).status_code == 400
    assert _post(server, "/pause_generation", json={"mode": "retract_all"}).status_code == 400
    assert _post(server, "/update_weights_from_disk", json={}).status_code == 400
    assert not _is_paused(server)


def test_the_routes_need_the_flag(request, tmp_path_factory):
    main = main_server(request, tmp_path_factory)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert _post(main, "/pause", headers=headers).status_code == 404
    assert _post(main, "/update_weights_from_disk", json={"model_path": "x"}, headers=headers).status_code == 404

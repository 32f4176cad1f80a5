"""Token ids in and out, as RL loops drive a rollout server: SGLang's native /generate (and its /get_model_info,
/flush_cache, /health_generate) and vLLM's `return_token_ids` on the OpenAI routes, against a live server.

Greedy outputs must equal `LLM.generate` on the same model; a stream's last event must equal the whole answer;
logprobs must be the model's; bad requests get a 400 naming the field and the server serves on.
"""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from tests.server_util import (API_KEY, CHAT, MODEL_NAME, chat_reference, greedy_reference, main_server,
                               post_in_process, reference_llm, sse_events)

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return main_server(request, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return reference_llm(tmp_path_factory)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=120)


def _generate(server, **body):
    r = _post(server, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def _events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, headers=HEADERS, timeout=120) as r:
        assert r.status_code == 200
        return sse_events(list(r.iter_lines()))


def test_generate_text_greedy_equals_llm(server, llm):
    ref = greedy_reference(llm, [PROMPT], 8)[0]
    out = _generate(server, text=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 8})
    assert out["text"] == ref.outputs[0].text
    assert out["output_ids"] == ref.outputs[0].token_ids
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ref.prompt_token_ids), 8)
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0 and meta["id"]


def test_generate_input_ids_batch_keeps_order_and_rids(server, llm):
    prompts = [[128000, 791, 6864, 315], [128000, 9906, 1917], [128000, 40, 1093, 311, 1376]]
    refs = greedy_reference(llm, prompts, 6)
    outs = _generate(server, input_ids=prompts, rid=["a", "b", "c"], return_prompt_token_ids=True,
                     sampling_params=[{"temperature": 0, "max_new_tokens": 6}] * 3)
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b", "c"]
    assert [o["output_ids"] for o in outs] == [r.outputs[0].token_ids for r in refs]
    assert [o["prompt_token_ids"] for o in outs] == prompts


def test_generate_stops_as_llm_does(server, llm):
    ids = greedy_reference(llm, [PROMPT], 12)[0].outputs[0].token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    ref = greedy_reference(llm, [PROMPT], 12, stop_token_ids=[ids[k]])[0].outputs[0]
    out = _generate(server, text=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                          "stop_token_ids": [ids[k]]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert out["output_ids"] == ref.token_ids and out["text"] == ref.text
    stop_text = ref.text[-3:] if len(ref.text) >= 3 else None
    if stop_text and stop_text.strip():
        out = _generate(server, text=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                              "stop": [stop_text], "no_stop_trim": True})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
        assert out["text"].endswith(stop_text)


def test_generate_stream_ends_with_the_whole_answer(server):
    body = dict(text=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 8})
    whole = _generate(server, **body)
    events = _events(server, "/generate", {**body, "stream": True})
    assert len(events) > 1
    for before, after in zip(events, events[1:]):     # text and ids so far: each event extends the last
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_generate_n_streams_each_sequence_with_its_index(server):
    events = _events(server, "/generate", dict(text=PROMPT, stream=True, sampling_params={
        "temperature": 1.0, "max_new_tokens": 5, "n": 2, "sampling_seed": 3}))
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1]
    assert all(len(e["output_ids"]) == 5 for e in finals.values())


def test_generate_logprobs_are_the_models(server, llm):
    from atlasjax import SamplingParams
    ref = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=2))[0]
    out = _generate(server, text=PROMPT, return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                    return_text_in_logprobs=True, sampling_params={"temperature": 0, "max_new_tokens": 4})
    meta = out["meta_info"]
    generated = meta["output_token_logprobs"]
    assert [t for _, t, _ in generated] == out["output_ids"] == ref.outputs[0].token_ids
    for (lp, t, text), entry in zip(generated, ref.outputs[0].logprobs):
        assert lp == pytest.approx(entry[t].logprob, abs=1e-4) and isinstance(text, str)
    prompt = meta["input_token_logprobs"]
    assert [t for _, t, _ in prompt] == ref.prompt_token_ids
    assert prompt[0][0] is None and meta["input_top_logprobs"][0] is None    # nothing predicts the first token
    for (lp, t, _), entry in zip(prompt[1:], ref.prompt_logprobs[1:]):
        assert lp == pytest.approx(entry[t].logprob, abs=1e-4)
    for top in meta["output_top_logprobs"] + meta["input_top_logprobs"][1:]:
        assert len(top) == 2 and top[0][0] >= top[1][0]
    for (lp, _, _), top in zip(generated, meta["output_top_logprobs"]):   # greedy: the chosen token is the best
        assert lp == pytest.approx(top[0][0], abs=1e-6)


def test_generate_max_new_tokens_zero_scores_the_prompt(server):
    scored = _generate(server, text=PROMPT, return_logprob=True, logprob_start_len=1,
                       sampling_params={"max_new_tokens": 0})
    generated = _generate(server, text=PROMPT, return_logprob=True, logprob_start_len=1,
                          sampling_params={"temperature": 0, "max_new_tokens": 2})
    assert scored["output_ids"] == [] and scored["text"] == ""
    assert scored["meta_info"]["completion_tokens"] == 0
    assert scored["meta_info"]["output_token_logprobs"] == []
    assert [t for _, t, _ in scored["meta_info"]["input_token_logprobs"]] == \
        [t for _, t, _ in generated["meta_info"]["input_token_logprobs"]]
    for (a, _, _), (b, _, _) in zip(scored["meta_info"]["input_token_logprobs"],
                                    generated["meta_info"]["input_token_logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("body, says", [
    ({"text": PROMPT, "input_ids": [1, 2]}, "exactly one of 'text' and 'input_ids'"),
    ({}, "exactly one of 'text' and 'input_ids'"),
    ({"input_ids": [1, "x"]}, "'input_ids' must be"),
    ({"input_ids": [10**7]}, "prompt token ids must be in"),
    ({"text": PROMPT, "sampling_params": {"max_new_tokns": 3}}, "unknown sampling parameters: max_new_tokns"),
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "'max_new_tokens' must be in"),
    ({"text": PROMPT, "sampling_params": {"json_schema": "{}"}}, "structured outputs ('json_schema')"),
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": 5000}}, "exceeds max_model_len"),
    ({"text": [PROMPT, PROMPT], "sampling_params": [{}]}, "'sampling_params' has 1 entries for 2 prompts"),
    ({"text": [PROMPT, PROMPT], "rid": ["x", "x"]}, "'rid' values must be distinct"),
    ({"text": PROMPT, "lora_path": "nope"}, "'lora_path' must name a loaded adapter"),
    ({"text": PROMPT, "top_logprobs_num": 2}, "'top_logprobs_num' needs 'return_logprob': true"),
    ({"text": PROMPT, "return_logprob": True, "logprob_start_len": 999}, "'logprob_start_len' (999) must be below"),
    ({"text": PROMPT, "image_data": "cat.png"}, "'image_data' is not supported"),
])
def test_generate_refuses_bad_requests_and_serves_on(server, body, says):
    r = _post(server, "/generate", body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert _generate(server, text=PROMPT, sampling_params={"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def _pages_free(server) -> tuple[int, int]:
    health = httpx.get(server.url + "/health").json()
    return health["kv_pages_free"], health["kv_pages_total"]


def _until_pages_free(server) -> bool:
    for _ in range(100):
        free, total = _pages_free(server)
        if free == total:
            return True
        time.sleep(0.05)
    return False


def test_abort_request_ends_a_stream_with_what_it_generated(server):
    body = dict(text=PROMPT, rid="rollout-7", stream=True,
                sampling_params={"max_new_tokens": 240, "ignore_eos": True, "temperature": 1.0})
    events = []
    with httpx.stream("POST", server.url + "/generate", json=body, headers=HEADERS, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: "):]))
            if len(events) == 1:
                assert _post(server, "/abort_request", {"rid": "rollout-7"}).status_code == 200
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["id"] == "rollout-7"
    assert 0 < len(last["output_ids"]) < 240 and len(last["output_ids"]) == last["meta_info"]["completion_tokens"]
    assert _until_pages_free(server)
    assert _post(server, "/abort_request", {"rid": "rollout-7"}).status_code == 200   # finished: no error


def test_a_client_leaving_a_stream_gives_its_pages_back(server):
    body = dict(text=PROMPT, rid="leaver", stream=True, sampling_params={"max_new_tokens": 240, "ignore_eos": True})
    with httpx.stream("POST", server.url + "/generate", json=body, headers=HEADERS, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break          # leaves after the first event: the connection closes
    assert _until_pages_free(server)
    again = _generate(server, text=PROMPT, rid="leaver", sampling_params={"max_new_tokens": 2})   # the rid is free
    assert again["meta_info"]["completion_tokens"] == 2


def test_abort_all_ends_whole_requests_in_flight(server):
    result = {}
    body = dict(text=[PROMPT, PROMPT + " and"], sampling_params={"max_new_tokens": 240, "ignore_eos": True})
    thread = threading.Thread(target=lambda: result.update(r=_post(server, "/generate", body)))
    thread.start()
    while thread.is_alive():
        _post(server, "/abort_request", {"abort_all": True})
        time.sleep(0.05)
    outs = result["r"].json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert all(len(o["output_ids"]) < 240 for o in outs)
    assert _until_pages_free(server)
    r = _post(server, "/abort_request", {})
    assert r.status_code == 400 and "'rid'" in r.json()["error"]["message"]


def test_sglang_operational_routes(server):
    info = httpx.get(server.url + "/get_model_info", headers=HEADERS).json()
    assert info["model_path"] == MODEL_NAME and info["weight_version"] == "default" and info["is_generation"]
    assert httpx.get(server.url + "/model_info", headers=HEADERS).json() == info
    server_info = httpx.get(server.url + "/get_server_info", headers=HEADERS).json()
    assert (server_info["context_len"], server_info["max_running_requests"]) == (256, 8)   # ENGINE_KWARGS
    assert (server_info["tp_size"], server_info["dp_size"]) == (1, 1) and server_info["max_total_num_tokens"] > 256
    assert httpx.get(server.url + "/server_info", headers=HEADERS).json() == server_info
    assert httpx.post(server.url + "/flush_cache", headers=HEADERS).status_code == 200
    assert httpx.get(server.url + "/health_generate", headers=HEADERS, timeout=120).status_code == 200


def test_completions_return_token_ids(server, llm):
    ref = greedy_reference(llm, [PROMPT], 6)[0]
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, return_token_ids=True)
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == ref.prompt_token_ids
    assert choice["token_ids"] == ref.outputs[0].token_ids
    events = _events(server, "/v1/completions", {**body, "stream": True})
    assert events[0]["choices"][0]["prompt_token_ids"] == ref.prompt_token_ids
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == ref.outputs[0].token_ids


def test_chat_return_token_ids(server, llm):
    ref = chat_reference(llm, CHAT, 6)
    body = dict(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0, return_token_ids=True)
    r = _post(server, "/v1/chat/completions", body).json()
    assert r["prompt_token_ids"] == ref.prompt_token_ids
    assert r["choices"][0]["token_ids"] == ref.outputs[0].token_ids
    events = _events(server, "/v1/chat/completions", {**body, "stream": True})
    assert events[0]["prompt_token_ids"] == ref.prompt_token_ids
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == ref.outputs[0].token_ids
    plain = _post(server, "/v1/chat/completions", {**body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


# ---- in process, on a scripted engine (tests/test_reasoning.py): what needs no model


def _scripted_events(llm, body: dict, **app_kwargs) -> list[dict]:
    from serving.app import create_app
    r = post_in_process(create_app(llm, served_model_name=MODEL_NAME, **app_kwargs), "/generate", body)
    assert r.status_code == 200, r.text
    return sse_events(r.text.splitlines()) if body.get("stream") else r.json()


def test_incremental_streaming_output_sends_only_what_is_new():
    from tests.test_reasoning import ScriptedLLM
    pieces = ["Hel", "lo", " wor", "ld"]
    body = {"text": "Hi", "stream": True, "return_logprob": False}
    whole = _scripted_events(ScriptedLLM(pieces), body)
    assert [e["text"] for e in whole] == ["Hel", "Hello", "Hello wor", "Hello world"]
    new = _scripted_events(ScriptedLLM(pieces), body, incremental_streaming_output=True)
    assert [e["text"] for e in new] == pieces
    assert [e["output_ids"] for e in new] == [[0], [1], [2], [3]]
    assert new[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 3}
    assert new[-1]["meta_info"]["completion_tokens"] == 4


def test_lora_path_names_an_adapter_per_prompt():
    from atlasjax.lora import LoRARequest
    from tests.test_reasoning import ScriptedLLM

    class Recording(ScriptedLLM):
        async def generate(self, prompt_ids, params, request_id, priority=0, lora_request=None, cache_salt=None):
            self.loras.append((prompt_ids[-1], lora_request and lora_request.lora_name))
            async for delta in super().generate(prompt_ids, params, request_id, priority, lora_request, cache_salt):
                yield delta

    llm = Recording(["ok"])
    llm.loras, llm.engine.config = [], SimpleNamespace(enable_lora=True, max_lora_rank=8)
    adapters = {"sql": LoRARequest("sql", 1, "/nowhere")}
    outs = _scripted_events(llm, {"input_ids": [[1, 7], [1, 8]], "lora_path": ["sql", None]}, lora_modules=adapters)
    assert len(outs) == 2 and sorted(llm.loras) == [(7, "sql"), (8, None)]

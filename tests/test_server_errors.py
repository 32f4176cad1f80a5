"""Bad input, auth, size limits, a full queue and shutdown, against live servers.

Every bad request must get its status in the right error shape (never a 500), and the server
must answer a normal request right after it. A second small server (one slot, one waiting
place, no API key) is used for the 503 and the graceful-shutdown checks.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server_util import API_KEY, ENGINE_KWARGS, MODEL_NAME, main_server, metric_value, shared_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
MESSAGES = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG_PROMPT = [1000] * ENGINE_KWARGS["max_model_len"]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return main_server(request, tmp_path_factory)


@pytest.fixture(scope="module")
def queue_server(request, tmp_path_factory):
    """One slot and one waiting place, so a third concurrent request finds the queue full."""
    return shared_server(request, tmp_path_factory, "queue", "--max-waiting", "1",
                         engine_kwargs={**ENGINE_KWARGS, "max_num_seqs": 1})


def assert_served(url: str, headers=AUTH) -> None:
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_OPENAI = [
    # (id, path, body (dict or raw bytes), expected status, expected param)
    ("malformed_json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
    ("not_utf8", "/v1/completions", b"\xff\xfe{}", 400, None),
    ("body_is_array", "/v1/completions", b"[1, 2]", 400, None),
    ("nan_temperature", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("temperature_string", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("max_tokens_string", "/v1/completions", {**COMPLETION, "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens_zero", "/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("n_bool", "/v1/chat/completions", {**CHAT, "n": True}, 400, "n"),
    ("n_zero", "/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("stream_string", "/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("stop_number", "/v1/completions", {**COMPLETION, "stop": 5}, 400, "stop"),
    ("negative_temperature", "/v1/chat/completions", {**CHAT, "temperature": -1}, 400, None),
    ("top_p_zero", "/v1/chat/completions", {**CHAT, "top_p": 0}, 400, None),
    ("top_p_above_one", "/v1/completions", {**COMPLETION, "top_p": 1.5}, 400, None),
    ("presence_penalty", "/v1/chat/completions", {**CHAT, "presence_penalty": 3}, 400, None),
    ("huge_top_k", "/v1/completions", {**COMPLETION, "top_k": 10**12}, 400, "top_k"),
    ("logprobs_too_many", "/v1/completions", {**COMPLETION, "logprobs": 50}, 400, "logprobs"),
    ("top_logprobs_without_logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("unknown_model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 400, "model"),
    ("empty_messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("bad_role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("image_part", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, None),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools"),
    ("tool_choice", "/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    ("json_mode", "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("empty_prompt", "/v1/completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    ("prompt_wrong_type", "/v1/completions", {**COMPLETION, "prompt": {"text": "hi"}}, 400, "prompt"),
    ("token_id_out_of_vocab", "/v1/completions", {**COMPLETION, "prompt": [5, 10**8]}, 400, "prompt"),
    ("prompt_too_long", "/v1/completions", {**COMPLETION, "prompt": LONG_PROMPT}, 400, "prompt"),
    ("prompt_plus_max_tokens", "/v1/completions", {**COMPLETION, "prompt": LONG_PROMPT[:200], "max_tokens": 100},
     400, "max_tokens"),
    ("logit_bias_list", "/v1/completions", {**COMPLETION, "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("logit_bias_value", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("logit_bias_key", "/v1/chat/completions", {**CHAT, "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ("logit_bias_out_of_vocab", "/v1/completions", {**COMPLETION, "logit_bias": {str(10**8): 1}}, 400,
     "logit_bias"),
    ("allowed_token_ids_empty", "/v1/completions", {**COMPLETION, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("allowed_token_ids_not_ids", "/v1/chat/completions", {**CHAT, "allowed_token_ids": ["a"]}, 400,
     "allowed_token_ids"),
    ("allowed_token_ids_out_of_vocab", "/v1/chat/completions", {**CHAT, "allowed_token_ids": [10**8]}, 400,
     "allowed_token_ids"),
    ("truncate_prompt_tokens_zero", "/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("truncate_prompt_tokens_below", "/v1/completions", {**COMPLETION, "truncate_prompt_tokens": -2}, 400,
     "truncate_prompt_tokens"),
    ("stream_options_without_stream", "/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}},
     400, "stream_options"),
]


@pytest.mark.parametrize("path,body,status,param", [case[1:] for case in BAD_OPENAI],
                         ids=[case[0] for case in BAD_OPENAI])
def test_bad_openai_request_then_served(server, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers={**AUTH, "Content-Type": "application/json"}, timeout=60, **kwargs)
    error = assert_openai_error(r, status, param)
    assert error["type"] == "invalid_request_error"
    assert_served(server.url)


def test_context_length_error_when_streaming(server):
    body = {**COMPLETION, "prompt": LONG_PROMPT[:200], "max_tokens": 100, "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert_openai_error(r, 400, "max_tokens")


BAD_ANTHROPIC = [
    ("missing_max_tokens", {k: v for k, v in MESSAGES.items() if k != "max_tokens"}),
    ("system_role_in_messages", {**MESSAGES, "messages": [{"role": "system", "content": "x"}]}),
    ("tool_use", {**MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
    ("bad_stop_sequences", {**MESSAGES, "stop_sequences": 7}),
    ("too_long", {**MESSAGES, "messages": [{"role": "user", "content": "hi " * 300}]}),
]


@pytest.mark.parametrize("body", [case[1] for case in BAD_ANTHROPIC], ids=[case[0] for case in BAD_ANTHROPIC])
def test_bad_anthropic_request_then_served(server, body):
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"]
    assert_served(server.url)


def test_auth(server):
    assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json=CHAT), 401)
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
    assert assert_openai_error(r, 401)["type"] == "authentication_error"
    assert httpx.get(server.url + "/metrics").status_code == 401
    r = httpx.post(server.url + "/v1/messages", json=MESSAGES)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200          # stays open
    cross_origin = httpx.get(server.url + "/health", headers={"Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in cross_origin.headers     # CORS is off by default
    assert_served(server.url, headers={"x-api-key": API_KEY})


def test_unknown_route_and_method(server):
    assert_openai_error(httpx.get(server.url + "/v1/nope", headers=AUTH), 404)
    assert_openai_error(httpx.get(server.url + "/v1/chat/completions", headers=AUTH), 405)
    assert_served(server.url)


def test_oversized_body_gets_413(server):
    body = {**COMPLETION, "prompt": "x" * (2 << 20)}           # the test server's limit is 1 MiB
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert_openai_error(r, 413)

    def chunks():                                                # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert_openai_error(r, 413)
    assert_served(server.url)


def test_no_500_counted(server):
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert 'status="500"' not in text
    assert metric_value(text, 'atlasjax_http_requests_total{endpoint="/v1/chat/completions",status="400"}') > 0


def test_full_queue_gets_503_with_retry_after(queue_server):
    url = queue_server.url
    long_body = {**COMPLETION, "max_tokens": 150, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=long_body) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                await lines.__anext__()                                  # it holds the only slot
                waiting = asyncio.create_task(client.post("/v1/completions", json={**COMPLETION, "max_tokens": 1}))
                deadline = time.monotonic() + 30
                while metric_value((await client.get("/metrics")).text, "atlasjax_num_requests_waiting") < 1:
                    assert time.monotonic() < deadline, "the second request never queued"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)   # AsyncLLM reads the waiting count from stats, refreshed every step
                refused = await client.post("/v1/completions", json=COMPLETION)
            # leaving the stream aborts the running request; the waiting one then runs
            served = await waiting
            return refused, served
    refused, served = asyncio.run(scenario())
    error = assert_openai_error(refused, 503)
    assert refused.headers["Retry-After"] == "1" and error["code"] == "queue_full"
    assert served.status_code == 200
    assert_served(url, headers={})


def test_sigterm_drains_in_flight_stream_then_exits_cleanly(queue_server):
    body = {**COMPLETION, "max_tokens": 30, "stream": True}
    with httpx.stream("POST", queue_server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        queue_server.proc.terminate()
        rest = list(lines)
    assert "data: [DONE]" in rest
    assert sum('"finish_reason": "length"' in line for line in rest) == 1
    assert queue_server.stop(timeout=60) == 0
    assert "atlasjax: server stopped" in queue_server.log()

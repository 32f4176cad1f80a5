"""Anthropic extended thinking on /v1/messages: with `--reasoning-parser`, the answer's <think> part is
a `thinking` block before the `text` block, whole or streamed, as the official `anthropic` SDK reads
it; `thinking` switches the chat template's `enable_thinking`; earlier turns' thinking is dropped.

Driven in process with the scripted engine of test_reasoning.py (the tiny random model never writes
the tags)."""
from __future__ import annotations

import asyncio
import json
import os

import importlib

import anthropic
import pytest

from serving.app import create_app
from tests.server_util import API_KEY, ASSETS, MODEL_NAME
from tests.test_reasoning import PIECES, ScriptedLLM

QWEN3_TOKENIZER = os.path.join(ASSETS, "tokenizers", "qwen3")
QWEN3_TEMPLATE = os.path.join(ASSETS, "chat_templates", "Qwen-Qwen3-0.6B.jinja")
HI = [{"role": "user", "content": "Hi"}]
# the HTTP package the SDK is built on: httpx2 from anthropic 2.14 on, httpx before
HTTP = importlib.import_module("httpx2" if "httpx2" in dir(anthropic._base_client) else "httpx")


def _run(llm, parser, call):
    """call(client) against the app in process, with the anthropic SDK."""
    app = create_app(llm, served_model_name=MODEL_NAME, reasoning_parser=parser)

    async def go():
        async with HTTP.AsyncClient(transport=HTTP.ASGITransport(app=app), base_url="http://test") as http:
            client = anthropic.AsyncAnthropic(base_url="http://test", api_key=API_KEY, http_client=http, max_retries=0)
            return await call(client)
    return asyncio.run(go())


def _create(pieces, parser, **kwargs):
    async def call(client):
        return await client.messages.create(model=MODEL_NAME, messages=HI, max_tokens=50, **kwargs)
    return _run(ScriptedLLM(pieces), parser, call)


def _raw_stream(pieces, parser, **kwargs) -> list[dict]:
    """The stream's events as sent: (event name, data) pairs checked to agree."""
    async def call(client):
        r = await client.messages.with_raw_response.create(model=MODEL_NAME, messages=HI, max_tokens=50,
                                                           stream=True, **kwargs)
        return (await r.http_response.aread()).decode()
    events = []
    for chunk in _run(ScriptedLLM(pieces), parser, call).strip().split("\n\n"):
        name, data = chunk.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        events.append(event)
    return events


def test_answer_is_a_thinking_block_then_a_text_block():
    r = _create(PIECES, "qwen3", thinking={"type": "enabled", "budget_tokens": 20})
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "\nplan it\n" and r.content[1].text == "\n\nThe answer."
    assert r.usage.output_tokens == len(PIECES) and r.stop_reason == "end_turn"
    # the model's reasoning comes back whether or not the request asked for it
    assert _create(PIECES, "qwen3").content == r.content
    # without a parser the text is returned as generated, tags included
    plain = _create(PIECES, None)
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == "".join(PIECES)


def test_an_answer_cut_off_in_its_reasoning_is_one_thinking_block():
    r = _create(["still", " thinking"], "deepseek_r1")
    assert [(b.type, b.thinking) for b in r.content] == [("thinking", "still thinking")]
    assert [b.type for b in _create([""], "qwen3").content] == ["text"]   # an empty answer: one empty text block


def test_stream_sends_the_thinking_block_first_and_equals_the_whole_answer():
    events = _raw_stream(PIECES, "qwen3", thinking={"type": "enabled", "budget_tokens": 20})
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [(e["index"], e["delta"]) for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for i, d in deltas if i == 0) == "\nplan it\n"
    assert "".join(d.get("text", "") for i, d in deltas if i == 1) == "\n\nThe answer."
    assert not any("think>" in d.get("text", "") + d.get("thinking", "") for _, d in deltas)
    # each block opens, streams, closes before the next opens; a signature closes the thinking block
    order = [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events[1:-2]]
    first_text = order.index(("content_block_start", 1, None))
    assert order[first_text - 2:first_text] == [("content_block_delta", 0, "signature_delta"),
                                                ("content_block_stop", 0, None)]
    assert order[-1] == ("content_block_stop", 1, None)

    async def call(client):   # the SDK's accumulator builds the same message as the whole answer
        async with client.messages.stream(model=MODEL_NAME, messages=HI, max_tokens=50) as s:
            return await s.get_final_message()
    streamed = _run(ScriptedLLM(PIECES), "qwen3", call)
    blocks = [b.model_dump(include={"type", "thinking", "signature", "text"}) for b in streamed.content]
    assert blocks == [b.model_dump(exclude_none=True) for b in _create(PIECES, "qwen3").content]


def test_stream_without_a_parser_is_one_text_block():
    events = _raw_stream(PIECES, None)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text"]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "".join(PIECES)


@pytest.mark.parametrize("thinking, parser, match", [
    ({"type": "enabled", "budget_tokens": 20}, None, "--reasoning-parser"),
    ({"type": "sometimes"}, "qwen3", "thinking.type"),
    ({"type": "enabled"}, "qwen3", "budget_tokens"),
    ({"type": "enabled", "budget_tokens": "lots"}, "qwen3", "budget_tokens"),
    ({"type": "enabled", "budget_tokens": 50}, "qwen3", "less than max_tokens"),
    ("yes", "qwen3", "thinking"),
])
def test_bad_thinking_is_refused(thinking, parser, match):
    with pytest.raises(anthropic.BadRequestError, match=match) as e:
        _create(PIECES, parser, thinking=thinking)
    assert e.value.body["error"]["type"] == "invalid_request_error"


def _qwen3_prompt(messages, thinking=None, parser="qwen3") -> str:
    if not os.path.exists(QWEN3_TEMPLATE):
        pytest.skip(f"test assets not found at {QWEN3_TEMPLATE}")
    with open(QWEN3_TEMPLATE) as f:
        llm = ScriptedLLM(["ok"], QWEN3_TOKENIZER, f.read())

    async def call(client):
        extra = {} if thinking is None else {"thinking": thinking}
        return await client.messages.create(model=MODEL_NAME, messages=messages, max_tokens=50, **extra)
    _run(llm, parser, call)
    return llm.tokenizer.decode(llm.prompts[-1], skip_special_tokens=False)


def test_thinking_switches_the_templates_enable_thinking():
    off = _qwen3_prompt(HI, {"type": "disabled"}, parser=None)   # switching it off needs no parser
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # Qwen3's empty reasoning
    on = _qwen3_prompt(HI, {"type": "enabled", "budget_tokens": 20})
    assert on.endswith("<|im_start|>assistant\n") and on == _qwen3_prompt(HI, {"type": "adaptive"})
    assert on == _qwen3_prompt(HI)   # the template's default


def test_earlier_turns_thinking_blocks_are_dropped():
    turns = [{"role": "user", "content": "Say hello."},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet them", "signature": ""},
                                               {"type": "redacted_thinking", "data": "xyz"},
                                               {"type": "text", "text": "Hello."}]},
             {"role": "user", "content": "Again."}]
    plain = [turns[0], {"role": "assistant", "content": "Hello."}, turns[2]]
    assert _qwen3_prompt(turns) == _qwen3_prompt(plain)
    assert "greet them" not in _qwen3_prompt(turns)
    with pytest.raises(anthropic.BadRequestError, match="not supported"):   # a user turn cannot hold one
        _qwen3_prompt([{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}])

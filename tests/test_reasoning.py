"""`serve --reasoning-parser`: a chat answer's <think> part goes to `reasoning_content`, the rest to
`content`, the same whole or streamed however the text is cut into deltas.

The route tests drive the app in process with a scripted engine (the tiny random model never writes
the tags); a live server checks the flag end to end on the tiny model, whose answers have no tags."""
from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import pytest

from atlasjax.generation_config import GenerationDefaults
from atlasjax.metrics import EngineStats
from atlasjax.outputs import StreamDelta
from serving.app import create_app
from serving.reasoning import ReasoningStream, split_reasoning
from tests.server_util import MODEL_NAME, TOKENIZER_DIR, ServerProcess, tiny_model_dir

ANSWERS = ["<think>\nplan it\n</think>\n\nThe answer.", "No tags at all.", "<think>cut off before the end",
           "plan first</think>then answer", "<thi", "", "<think></think>x", "a</think>b</think>c"]


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", ANSWERS[0], ("\nplan it\n", "\n\nThe answer.")),
    ("qwen3", ANSWERS[1], (None, "No tags at all.")),           # thinking off: all content
    ("qwen3", ANSWERS[2], ("cut off before the end", None)),
    ("qwen3", ANSWERS[3], (None, "plan first</think>then answer")),   # never opened: content
    ("deepseek_r1", ANSWERS[3], ("plan first", "then answer")),  # opened by the template
    ("deepseek_r1", ANSWERS[1], ("No tags at all.", None)),     # cut off inside the reasoning
    ("deepseek_r1", ANSWERS[0], ("\nplan it\n", "\n\nThe answer.")),
    ("deepseek_r1", ANSWERS[7], ("a", "b</think>c")),
    ("qwen3", ANSWERS[6], (None, "x"))])
def test_split(parser, text, expected):
    assert split_reasoning(text, parser) == expected


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_stream_splits_as_the_whole_text_does(parser):
    rng = random.Random(0)
    for text in ANSWERS:
        for _ in range(30):
            stream, reasoning, content, i = ReasoningStream(parser), "", "", 0
            while i < len(text):
                j = i + rng.randint(1, 4)
                r, c = stream.add(text[i:j])
                reasoning, content, i = reasoning + r, content + c, j
            r, c = stream.finish()
            assert ((reasoning + r) or None, (content + c) or None) == split_reasoning(text, parser)


# ---- the chat route, in process, with a scripted engine


class ScriptedLLM:
    """Answers every request with the same text deltas, one token each; keeps the prompts it got."""

    def __init__(self, pieces: list[str], tokenizer_dir: str = TOKENIZER_DIR, chat_template: str | None = None):
        from atlasjax.tokenizer import Tokenizer
        self.pieces, self.stats, self.prompts = pieces, EngineStats(), []
        self.engine = SimpleNamespace(max_model_len=256, model_config=SimpleNamespace(vocab_size=200_000),
                                      generation_defaults=GenerationDefaults())
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        if self.tokenizer is None:
            pytest.skip(f"test assets not found at {tokenizer_dir}")
        if chat_template is not None:
            self.tokenizer = self.tokenizer.with_chat_template(chat_template)

    async def generate(self, prompt_ids, params, request_id, priority=0, lora_request=None, cache_salt=None):
        self.prompts.append(list(prompt_ids))
        for k, piece in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            yield StreamDelta(request_id, 0, [k], piece, last, "stop" if last else None)
            await asyncio.sleep(0)


def _chat(pieces, parser, stream):
    app = create_app(ScriptedLLM(pieces), served_model_name=MODEL_NAME, reasoning_parser=parser)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                "stream": stream, "max_tokens": 50})
            assert r.status_code == 200, r.text
            return r.text if stream else r.json()
    return asyncio.run(go())


PIECES = ["<th", "ink>\nplan", " it\n</", "think>\n\nThe", " answer."]


def test_chat_response_carries_reasoning_content():
    message = _chat(PIECES, "qwen3", False)["choices"][0]["message"]
    assert message == {"role": "assistant", "reasoning_content": "\nplan it\n", "content": "\n\nThe answer."}
    assert _chat(PIECES, None, False)["choices"][0]["message"] == {"role": "assistant", "content": "".join(PIECES)}


def test_chat_stream_carries_reasoning_deltas():
    events = [json.loads(line[6:]) for line in _chat(PIECES, "qwen3", True).splitlines()
              if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nplan it\n"
    assert "".join(d.get("content", "") for d in deltas) == "\n\nThe answer."
    assert not any("<think>" in d.get("content", "") or "</think>" in d.get("content", "") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # reasoning arrives before the answer, as it is generated
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:])


# ---- a live server


def test_server_flag(request, tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory)
    server = ServerProcess(model, str(tmp_path_factory.mktemp("reasoning_server") / "server.log"),
                           "--reasoning-parser", "deepseek_r1")
    request.addfinalizer(server.stop)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    message = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
    # the template opens no <think> here, so under deepseek_r1 the tag-less answer is all reasoning
    assert message["content"] is None and message["reasoning_content"]
    text = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 6,
                                                             "temperature": 0}, timeout=120).json()
    assert "reasoning_content" not in text["choices"][0]   # completions stay plain text


def test_cors_lets_a_browser_read_the_request_id():
    """With --cors-origins a browser page may read X-Request-Id (an exposed header) besides the body.
    (The scripted engine of this file serves the app; the route is the chat one.)"""
    app = create_app(ScriptedLLM(["Hi"]), served_model_name=MODEL_NAME, cors_origins=["http://ui.example"])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/chat/completions", headers={"Origin": "http://ui.example",
                                                                       "X-Request-Id": "page-1"},
                                     json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
    r = asyncio.run(go())
    assert r.status_code == 200 and r.headers["x-request-id"] == "page-1"
    assert r.headers["access-control-allow-origin"] == "http://ui.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()

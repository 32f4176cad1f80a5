"""The reasoning budget (`thinking_token_budget` on chat completions, Anthropic's `budget_tokens`): an
answer still reasoning after its first `budget` tokens is closed with "\\n</think>\\n\\n" and goes on to
its answer within max_tokens, whole or streamed, and its pages are all given back.

The app runs in process on the tiny random Llama under `--reasoning-parser deepseek_r1` (its template
opens no <think>, so every answer starts as reasoning and never closes it itself). The reference is
the same model by hand: the first `budget` greedy tokens, the close tag, then a greedy continuation
of the prompt and everything so far."""
from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import pytest

from atlasjax import SamplingParams
from serving.app import create_app
from serving.thinking_budget import CLOSE_TEXT
from tests.server_util import ENGINE_KWARGS, MODEL_NAME, reference_llm, tiny_model_dir
from tests.test_anthropic_thinking import HTTP

MESSAGES = [{"role": "user", "content": "Think about it."}]
BUDGET, MAX_TOKENS = 4, 16


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return reference_llm(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from atlasjax.async_llm import AsyncLLM
    async_llm = AsyncLLM(tiny_model_dir(tmp_path_factory), **ENGINE_KWARGS)
    yield async_llm
    async_llm.shutdown(drain=False)


def _post(engine, path, body, parser="deepseek_r1", sdk=False, stream=False):
    app = create_app(engine, served_model_name=MODEL_NAME, reasoning_parser=parser)

    async def go():
        transport = (HTTP if sdk else httpx).ASGITransport(app=app)
        async with (HTTP if sdk else httpx).AsyncClient(transport=transport, base_url="http://test") as client:
            if sdk:
                claude = anthropic.AsyncAnthropic(base_url="http://test", api_key="x", http_client=client, max_retries=0)
                if stream:
                    async with claude.messages.stream(model=MODEL_NAME, **body) as s:
                        return await s.get_final_message()
                return await claude.messages.create(model=MODEL_NAME, **body)
            return await client.post(path, json={"model": MODEL_NAME, **body})
    out = asyncio.run(go())
    _assert_pages_back(engine)
    return out


def _assert_pages_back(engine, timeout=30.0):
    pool, end = engine.engine.pool, time.monotonic() + timeout
    while (engine.engine.has_unfinished() or pool.num_free_pages != pool.num_pages) and time.monotonic() < end:
        time.sleep(0.05)
    assert pool.num_free_pages == pool.num_pages and not engine.engine.has_unfinished()


def _reference(llm, budget=BUDGET, max_tokens=MAX_TOKENS, keep_last=None):
    """(reasoning text, answer text, tokens in all) of a greedy answer closed at the budget, by hand
    (keep_last: on the prompt's last tokens only, as truncate_prompt_tokens asks)."""
    prompt = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=1))[0].prompt_token_ids
    prompt = prompt[-keep_last:] if keep_last else prompt
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=budget))[0].outputs[0]
    close = llm.tokenizer.encode(CLOSE_TEXT, add_special_tokens=False)
    rest = llm.generate([prompt + first.token_ids + close],
                        SamplingParams(temperature=0, max_tokens=max_tokens - budget - len(close)))[0].outputs[0]
    return first.text, rest.text, budget + len(close) + len(rest.token_ids)


def _chat(engine, stream=False, **body):
    return _post(engine, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                  "stream": stream, **body})


def test_chat_reasoning_is_closed_at_the_budget(engine, llm):
    reasoning, answer, num_tokens = _reference(llm)
    r = _chat(engine, thinking_token_budget=BUDGET)
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == reasoning + "\n"
    assert message["content"] == "\n\n" + answer
    assert body["usage"]["completion_tokens"] == num_tokens
    # without the budget the same request reasons to max_tokens and never answers
    free = _chat(engine).json()["choices"][0]["message"]
    assert free["content"] is None and free["reasoning_content"].startswith(reasoning)
    # a budget at or past max_tokens changes nothing
    assert _chat(engine, thinking_token_budget=MAX_TOKENS).json()["choices"][0]["message"] == free


def test_a_truncated_prompt_is_cut_once_not_again_after_the_close_tag(engine, llm):
    """truncate_prompt_tokens cuts the request's prompt; the answer after the close tag continues that
    prompt and the reasoning, not their last k tokens."""
    reasoning, answer, num_tokens = _reference(llm, keep_last=6)
    body = _chat(engine, thinking_token_budget=BUDGET, truncate_prompt_tokens=6).json()
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == num_tokens
    assert body["choices"][0]["message"] == {"role": "assistant", "reasoning_content": reasoning + "\n",
                                             "content": "\n\n" + answer}


def test_chat_stream_equals_the_whole_answer(engine, llm):
    reasoning, answer, _ = _reference(llm)
    r = _chat(engine, stream=True, thinking_token_budget=BUDGET, stream_options={"include_usage": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning + "\n"
    assert "".join(d.get("content", "") for d in deltas) == "\n\n" + answer
    finishes = [e["choices"][0].get("finish_reason") for e in events if e["choices"]]
    assert [f for f in finishes if f] == ["length"]      # one completion, finished once
    assert events[-1]["usage"]["completion_tokens"] == _reference(llm)[2]


def test_logprobs_cover_every_token_the_close_tag_included(engine, llm):
    r = _chat(engine, thinking_token_budget=BUDGET, logprobs=True).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    close = llm.tokenizer.encode(CLOSE_TEXT, add_special_tokens=False)
    assert [c["logprob"] for c in content[BUDGET:BUDGET + len(close)]] == [0.0] * len(close)   # forced


def test_no_room_for_the_close_tag_ends_at_the_budget(engine, llm):
    close = llm.tokenizer.encode(CLOSE_TEXT, add_special_tokens=False)
    r = _chat(engine, thinking_token_budget=MAX_TOKENS - len(close) + 1).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert r["usage"]["completion_tokens"] == MAX_TOKENS - len(close) + 1


def test_several_sampled_choices_each_keep_their_budget(engine):
    r = _chat(engine, thinking_token_budget=BUDGET, n=3, temperature=1.0, seed=7).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for c in r["choices"]:
        assert c["message"]["reasoning_content"] is not None and c["message"]["content"].startswith("\n\n")
    assert r["usage"]["completion_tokens"] <= 3 * MAX_TOKENS
    again = _chat(engine, thinking_token_budget=BUDGET, n=3, temperature=1.0, seed=7).json()
    assert again["choices"] == r["choices"]    # seeded: the same answers, continuation included


def test_anthropic_budget_tokens(engine, llm):
    reasoning, answer, num_tokens = _reference(llm)
    r = _post(engine, None, {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0},
                             "thinking": {"type": "enabled", "budget_tokens": BUDGET}}, sdk=True)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in r.content] == [
        ("thinking", reasoning + "\n"), ("text", "\n\n" + answer)]
    assert r.usage.output_tokens == num_tokens
    streamed = _post(engine, None, {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0},
                                    "thinking": {"type": "enabled", "budget_tokens": BUDGET}}, sdk=True, stream=True)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in streamed.content] == [
        ("thinking", reasoning + "\n"), ("text", "\n\n" + answer)]
    assert streamed.usage.output_tokens == num_tokens


def test_a_budget_needs_the_reasoning_parser(engine):
    r = _post(engine, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "thinking_token_budget": 2},
              parser=None)
    assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]
    bad = _chat(engine, thinking_token_budget=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"

"""The Anthropic Messages API through the official `anthropic` SDK against a live server.

A Messages request is the same chat as an OpenAI one (system first, then the turns), so greedy
text must equal `LLM.chat` on the same messages; streaming must send Anthropic's event sequence.
"""
from __future__ import annotations

import anthropic
import pytest

from tests.server_util import API_KEY, MODEL_NAME, main_server, reference_llm

SYSTEM = "You are terse."
GREEDY = {"temperature": 0}  # sent as an extra field: anthropic SDK 2.x has no sampling arguments
TURNS = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "Again, louder."}]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return main_server(request, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return reference_llm(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def reference(llm, max_tokens: int):
    from atlasjax import SamplingParams
    messages = [{"role": "system", "content": SYSTEM}] + TURNS
    return llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]


def test_message_greedy_equals_llm(client, llm):
    ref = reference(llm, 10)
    r = client.messages.create(model=MODEL_NAME, system=SYSTEM, messages=TURNS, max_tokens=10, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL_NAME
    assert [block.type for block in r.content] == ["text"]
    assert r.content[0].text == ref.outputs[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.usage.input_tokens == len(ref.prompt_token_ids)
    assert r.usage.output_tokens == 10


def test_text_blocks_equal_plain_strings(client, llm):
    ref = reference(llm, 6)
    blocks = [{"role": t["role"], "content": [{"type": "text", "text": t["content"]}]} for t in TURNS]
    r = client.messages.create(model=MODEL_NAME, system=[{"type": "text", "text": SYSTEM}], messages=blocks,
                               max_tokens=6, extra_body=GREEDY)
    assert r.content[0].text == ref.outputs[0].text


def test_stream_event_sequence(client, llm):
    ref = reference(llm, 10)
    with client.messages.stream(model=MODEL_NAME, system=SYSTEM, messages=TURNS, max_tokens=10,
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    # The SDK adds derived "text" events after each content_block_delta; the wire events are the rest.
    wire = [t for t in types if t != "text"]
    assert wire[:2] == ["message_start", "content_block_start"]
    assert wire[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(wire[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.usage.input_tokens == len(ref.prompt_token_ids) and start.content == []
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == ref.outputs[0].text == final.content[0].text
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 10


def test_stop_sequence(client, llm):
    full = reference(llm, 16).outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = client.messages.create(model=MODEL_NAME, system=SYSTEM, messages=TURNS, max_tokens=16, extra_body=GREEDY,
                               stop_sequences=[stop])
    assert r.content[0].text == full[:full.index(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with client.messages.stream(model=MODEL_NAME, system=SYSTEM, messages=TURNS, max_tokens=16, extra_body=GREEDY,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == full[:full.index(stop)] and final.stop_reason == "stop_sequence"


def test_count_tokens(client, llm):
    r = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=TURNS)
    assert r.input_tokens == len(reference(llm, 1).prompt_token_ids)


def test_errors_in_anthropic_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL_NAME, messages=TURNS, max_tokens=0)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="does not exist"):
        client.messages.create(model="claude-nonexistent", messages=TURNS, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        client.messages.create(model=MODEL_NAME, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}],
            max_tokens=4)
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL_NAME, messages=TURNS, max_tokens=4)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = client.messages.create(model=MODEL_NAME, messages=TURNS, max_tokens=2)
    assert r.usage.output_tokens == 2


def test_a_last_assistant_message_is_continued(client, llm):
    # Anthropic's prefill: the answer continues the last assistant message, in the same turn
    from atlasjax import SamplingParams
    prefill = TURNS + [{"role": "assistant", "content": "HELLO"}]
    messages = [{"role": "system", "content": SYSTEM}] + prefill
    ref = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6), continue_final_message=True)[0]
    prompt = llm.tokenizer.decode(ref.prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("HELLO")   # the turn is left open: no end-of-turn, no new header
    r = client.messages.create(model=MODEL_NAME, system=SYSTEM, messages=prefill, max_tokens=6, extra_body=GREEDY)
    assert r.content[0].text == ref.outputs[0].text and r.usage.input_tokens == len(ref.prompt_token_ids)
    count = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=prefill)
    assert count.input_tokens == len(ref.prompt_token_ids)
    # an empty final assistant message starts the assistant's turn, as if it were absent
    empty = client.messages.create(model=MODEL_NAME, system=SYSTEM, max_tokens=6, extra_body=GREEDY,
                                   messages=TURNS + [{"role": "assistant", "content": ""}])
    assert empty.content[0].text == reference(llm, 6).outputs[0].text

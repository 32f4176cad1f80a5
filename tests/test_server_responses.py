"""The OpenAI Responses API (/v1/responses) through the official `openai` SDK against a live server.

A greedy response must equal `LLM.chat` on the same messages (instructions as the system message);
streaming must give the same text through OpenAI's event sequence; `previous_response_id` must
continue the stored conversation (without the earlier instructions); GET and DELETE must see what was
stored; unsupported fields must get a 400 naming them. Reasoning items are checked in process with a
scripted engine (the tiny random model never writes <think> tags).
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from serving.app import create_app
from tests.server_util import API_KEY, MODEL_NAME, chat_reference, main_server, reference_llm
from tests.test_reasoning import ScriptedLLM

QUESTION = "Name three colors."
INSTRUCTIONS = "You are terse."


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return main_server(request, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return reference_llm(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_response_equals_chat_with_usage(client, llm):
    ref = chat_reference(llm, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 8)
    r = client.responses.create(model=MODEL_NAME, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=8,
                                temperature=0, metadata={"run": "1"})
    assert r.output_text == ref.outputs[0].text
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    # the answer ran into max_output_tokens: OpenAI calls that incomplete
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == len(ref.prompt_token_ids)
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.id.startswith("resp_") and r.instructions == INSTRUCTIONS and r.metadata == {"run": "1"}


def test_a_stop_completes_the_response(client, llm):
    ref = chat_reference(llm, [{"role": "user", "content": QUESTION}], 8).outputs[0].text
    stop = ref[len(ref) // 2:len(ref) // 2 + 3]       # vLLM's extra `stop`, somewhere inside the greedy answer
    r = client.responses.create(model=MODEL_NAME, input=[{"role": "user", "content": QUESTION}], max_output_tokens=8,
                                temperature=0, extra_body={"stop": [stop]})
    assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
    assert r.output_text == ref[:ref.index(stop)]


def test_stream_sends_openai_events_with_the_same_text(client):
    kwargs = dict(model=MODEL_NAME, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text
    assert events[-2].item.id == events[2].item.id == final.output[0].id
    assert final.usage.output_tokens == 8 and final.status == "incomplete"


def test_previous_response_id_continues_the_conversation(client, llm):
    first = client.responses.create(model=MODEL_NAME, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=6,
                                    temperature=0)
    second = client.responses.create(model=MODEL_NAME, input="And two more?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # the earlier instructions are not carried over (OpenAI's rule); the earlier answer is
    ref = chat_reference(llm, [{"role": "user", "content": QUESTION},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "And two more?"}], 6)
    assert second.output_text == ref.outputs[0].text
    assert second.usage.input_tokens == len(ref.prompt_token_ids)
    assert second.previous_response_id == first.id


def test_stored_responses_can_be_read_and_deleted(client):
    r = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.output_tokens == 3
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="more", previous_response_id=r.id, max_output_tokens=2)
    unstored = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_list_the_requests_own_input_in_pages(client):
    turns = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."},
             {"role": "user", "content": "Three?"}]
    r = client.responses.create(model=MODEL_NAME, input=turns, instructions=INSTRUCTIONS, max_output_tokens=2)
    newest_first = client.responses.input_items.list(r.id)
    assert [item.content[0].text for item in newest_first.data] == ["Three?", "Two.", "One."]
    assert [item.role for item in newest_first.data] == ["user", "assistant", "user"]   # no instructions
    first = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [item.content[0].text for item in first.data] == ["One.", "Two."] and first.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=first.last_id)
    assert [item.content[0].text for item in rest.data] == ["Three?"] and not rest.has_more
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(r.id, limit=101)


def test_logprobs_of_each_output_token(client):
    r = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=5, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 5 and "".join(lp.token for lp in logprobs) == r.output_text
    for lp in logprobs:
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token   # greedy: the likeliest
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
        assert lp.logprob >= lp.top_logprobs[1].logprob


def test_truncation_auto_drops_the_oldest_messages(client):
    long_turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "words " * 30}
                  for i in range(8)] + [{"role": "user", "content": QUESTION}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input=long_turns, max_output_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.responses.create(model=MODEL_NAME, input=long_turns, max_output_tokens=4, truncation="auto",
                                temperature=0)
    assert r.usage.output_tokens == 4 and r.usage.input_tokens + 4 <= 256      # the server's max_model_len


@pytest.mark.parametrize("body, param", [
    ({"input": QUESTION, "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}],
      "max_output_tokens": 2}, "input[0].content"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0]"),
    ({"input": ""}, "input"),
    ({"input": QUESTION, "background": True}, "background"),
    ({"input": QUESTION, "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": QUESTION, "max_output_tokens": 0}, "max_output_tokens"),
])
def test_unsupported_or_malformed_requests_get_a_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL_NAME, **body},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- reasoning items, in process with a scripted engine


PIECES = ["<th", "ink>\nplan", " it\n</", "think>\n\nThe", " answer."]


def _respond(stream: bool):
    app = create_app(ScriptedLLM(PIECES), served_model_name=MODEL_NAME, reasoning_parser="qwen3")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            r = await client.post("/v1/responses", json={"input": "Hi", "stream": stream, "max_output_tokens": 50})
            assert r.status_code == 200, r.text
            if not stream:
                return r.json()
            return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    return asyncio.run(go())


def test_reasoning_comes_back_as_a_reasoning_item_before_the_message():
    r = _respond(stream=False)
    assert [item["type"] for item in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "\nplan it\n"}]
    assert r["output"][1]["content"][0]["text"] == "\n\nThe answer."
    assert r["status"] == "completed"
    # one token per piece: the three before the piece that starts the answer are reasoning
    assert r["usage"]["output_tokens"] == 5 and r["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_reasoning_streams_as_its_own_item():
    events = _respond(stream=True)
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    content = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, content) == ("\nplan it\n", "\n\nThe answer.")
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == ["reasoning", "message"] and done == [0, 1]
    # the reasoning item closes before the message opens
    types = [e["type"] for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    final = events[-1]
    assert final["type"] == "response.completed"
    assert [item["content"][0]["text"] for item in final["response"]["output"]] == [reasoning, content]

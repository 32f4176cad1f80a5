"""OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}, GET
/v1/responses/{response_id}/input_items.

A request's `instructions`, the stored conversation its `previous_response_id` names and its own
`input` (responses_input.py) render with the chat template like a chat; the answer comes back as
output items (responses_output.py): a `message` with `output_text`, after a `reasoning` item under
`--reasoning-parser`. `max_output_tokens` reached makes the response `incomplete`. Streaming sends
OpenAI's named events: response.created, response.in_progress, the items' events, then
response.completed (or response.incomplete), each with a `sequence_number`. With `store` (the
default) the response is kept (response_store.py) for GET and for later turns' `previous_response_id`.
`truncation: "auto"` drops the conversation's oldest messages until the prompt fits.
"""
from __future__ import annotations

import contextlib
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from atlasjax.sampling_params import MAX_LOGPROBS
from serving.bridge import Job, first_delta, stream_jobs, until_disconnect, with_first
from serving.errors import APIError, invalid
from serving.protocol import Fields, chat_render_options, sampling_params
from serving.responses_input import check_supported, input_messages, instructions_message, wants_logprobs
from serving.responses_output import ResponseOutput, item_id
from serving.state import SSE_HEADERS, ServerState, new_id, read_json, server_state, sse


def _previous_conversation(f: Fields, state: ServerState) -> list[dict]:
    previous_id = f.str("previous_response_id")
    if previous_id is None:
        return []
    if not state.responses.enabled:
        raise invalid("this server stores no responses (--max-stored-responses 0), so 'previous_response_id' "
                      "cannot be used; send the whole conversation as 'input'", param="previous_response_id")
    entry = state.responses.get(previous_id)
    if entry is None:
        raise APIError(404, f"no stored response has the id '{previous_id}' (responses are kept in the server's "
                            "memory: a restart or --max-stored-responses drops them)", param="previous_response_id")
    return list(entry.conversation)


async def _prompt(state: ServerState, f: Fields, instructions: list[dict], conversation: list[dict],
                  params, render: dict) -> list[int]:
    """The rendered prompt; with truncation "auto" the oldest messages go (never the instructions or the
    last message) until the prompt leaves room for max_output_tokens (or one token)."""
    auto = f.str("truncation", "disabled") == "auto"
    room = params.max_tokens or 1
    while True:
        ids = params.truncated_prompt(await state.chat_prompt(instructions + conversation, "input", **render),
                                      state.max_model_len)
        if not auto or len(ids) + room <= state.max_model_len or len(conversation) <= 1:
            return ids
        conversation = conversation[1:]


def _head(f: Fields, rid: str, model: str, params, previous: str | None) -> dict:
    """The fields a response repeats from its request."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": f.body.get("instructions"),
            "max_output_tokens": f.body.get("max_output_tokens"), "metadata": f.object("metadata") or {},
            "output": [], "parallel_tool_calls": f.bool("parallel_tool_calls", True),
            "previous_response_id": previous, "reasoning": f.object("reasoning"), "store": f.bool("store", True),
            "temperature": params.temperature, "top_p": params.top_p, "top_logprobs": f.body.get("top_logprobs"),
            "text": {"format": {"type": "text"}}, "tool_choice": f.raw("tool_choice", "auto"), "tools": [],
            "truncation": f.str("truncation", "disabled"), "background": False, "usage": None,
            **({"user": f.str("user")} if f.body.get("user") is not None else {})}


async def create_response(request: Request):
    state = server_state(request)
    f = Fields(await read_json(request))
    model, lora = state.generation_model(f)
    check_supported(f)
    own_input = input_messages(f)
    conversation = _previous_conversation(f, state) + own_input
    instructions = instructions_message(f)
    top_logprobs = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    logprobs = (top_logprobs or 0) if wants_logprobs(f) else None
    max_tokens = f.int("max_output_tokens", None, lo=1)
    params = sampling_params(f, max_tokens=max_tokens, max_model_len=state.max_model_len, logprobs=logprobs,
                             model_defaults=state.model_defaults)
    render = chat_render_options(f)
    effort = (f.object("reasoning") or {}).get("effort")
    if effort is not None:   # a template variable, as vLLM passes it (gpt-oss-style templates read it)
        render["template_kwargs"] = {"reasoning_effort": effort, **render["template_kwargs"]}
    prompt_ids = await _prompt(state, f, instructions, conversation, params, render)
    if max_tokens is None:
        params = state.default_max_tokens(params, prompt_ids)
    state.check_prompt(prompt_ids, params, "input")
    rid, engine_id = new_id("resp_", request)
    deltas = stream_jobs(state.llm, [Job(engine_id, prompt_ids, params, priority=state.priority(f),
                                         lora_request=lora, cache_salt=state.cache_salt(f))], state.metrics)
    out = ResponseOutput(state.reasoning_parser, logprobs, state.tokens_as_ids(f), state.reasoning_end_ids())
    head = _head(f, rid, model, params, f.str("previous_response_id"))

    def finished() -> dict:
        now = int(time.time())
        cached = out.num_cached_tokens or 0
        response = {**head, "status": out.status, "output": out.output(),
                    "incomplete_details": {"reason": "max_output_tokens"} if out.status == "incomplete" else None,
                    **({"completed_at": now} if out.status == "completed" else {}),
                    "usage": {"input_tokens": len(prompt_ids), "input_tokens_details": {"cached_tokens": cached},
                              "output_tokens": out.num_tokens,
                              "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens},
                              "total_tokens": len(prompt_ids) + out.num_tokens}}
        if head["store"]:
            state.responses.put(response, conversation + [{"role": "assistant", "content": out.conversation_text}],
                                input_items(own_input))
        return response

    first = await first_delta(request, deltas)
    if f.bool("stream"):
        return StreamingResponse(_events(head, first, deltas, out, finished), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def consume():
        async with contextlib.aclosing(deltas):
            async for _, delta in with_first(first, deltas):
                out.add(delta)
    await until_disconnect(request, consume())
    out.finish()
    return JSONResponse(finished())


async def _events(head, first, deltas, out: ResponseOutput, finished):
    sequence = iter(range(1 << 62))

    def event(data: dict) -> str:
        return sse({**data, "sequence_number": next(sequence)}, data["type"])
    yield event({"type": "response.created", "response": head})
    yield event({"type": "response.in_progress", "response": head})
    async with contextlib.aclosing(deltas):
        try:
            async for _, delta in with_first(first, deltas):
                for e in out.add(delta):
                    yield event(e)
        except APIError as e:
            yield event({"type": "error", "code": e.code, "message": e.message, "param": e.param})
            return
    for e in out.finish():
        yield event(e)
    response = finished()
    yield event({"type": f"response.{response['status']}", "response": response})


async def get_response(request: Request) -> JSONResponse:
    return JSONResponse(_stored(request).response)


def input_items(messages: list[dict]) -> list[dict]:
    """A request's input messages as the message items GET .../input_items lists."""
    return [{"id": item_id("msg"), "type": "message", "role": m["role"], "status": "completed",
             "content": [{"type": "output_text" if m["role"] == "assistant" else "input_text", "text": m["content"],
                          **({"annotations": []} if m["role"] == "assistant" else {})}]} for m in messages]


async def list_input_items(request: Request) -> JSONResponse:
    """OpenAI's paginated list of a stored response's input items: `order` (desc by default), `after` (an
    item id), `limit` (1-100, default 20)."""
    items = list(_stored(request).input_items)
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise invalid("'limit' must be an integer in [1, 100]", param="limit")
    if order == "desc":
        items.reverse()
    if "after" in query:
        ids = [item["id"] for item in items]
        if query["after"] not in ids:
            raise invalid(f"no input item has the id '{query['after']}'", param="after")
        items = items[ids.index(query["after"]) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def delete_response(request: Request) -> JSONResponse:
    state, response_id = server_state(request), request.path_params["response_id"]
    _stored(request)
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _stored(request: Request):
    response_id = request.path_params["response_id"]
    entry = server_state(request).responses.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response has the id '{response_id}'", param="response_id")
    return entry


ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
]

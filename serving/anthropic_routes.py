"""Anthropic-compatible routes: POST /v1/messages and /v1/messages/count_tokens.

The request (system + alternating user/assistant messages with text content) is rendered with
the model's chat template like an OpenAI chat. Streaming sends Anthropic's event sequence:
message_start, content_block_start, content_block_delta (text_delta)..., content_block_stop,
message_delta (stop_reason, usage), message_stop. Errors use Anthropic's error shape
(errors.py picks it from the path).
"""
from __future__ import annotations

import contextlib

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from serving.bridge import Job, collect, first_delta, stream_jobs, until_disconnect, with_first
from serving.errors import APIError, error_body, invalid
from serving.protocol import Fields, check_model, sampling_params, text_content
from serving.state import SSE_HEADERS, ServerState, new_id, read_json, server_state, sse

UNSUPPORTED = ("tools", "tool_choice", "thinking")


def _messages(f: Fields) -> list[dict]:
    for name in UNSUPPORTED:
        if f.body.get(name):
            raise invalid(f"'{name}' is not supported yet", param=name)
    if (f.object("output_config") or {}).get("format"):
        raise invalid("structured outputs (output_config.format) are not supported yet", param="output_config")
    out = []
    system = f.body.get("system")
    if system is not None:
        out.append({"role": "system", "content": text_content(system, "system")})
    messages = f.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"'messages[{i}]' must be an object with role 'user' or 'assistant'", param="messages")
        out.append({"role": m["role"], "content": text_content(m.get("content"), f"messages[{i}].content")})
    return out


async def _prepare(request: Request, state: ServerState) -> tuple[Fields, str, list[int]]:
    f = Fields(await read_json(request))
    model = check_model(f, state.model_name)
    messages = _messages(f)
    # a last assistant message is a prefill: the answer continues it (Anthropic's behaviour)
    return f, model, await state.chat_prompt(messages, continue_final_message=messages[-1]["role"] == "assistant")


async def count_tokens(request: Request) -> JSONResponse:
    state = server_state(request)
    _, _, prompt_ids = await _prepare(request, state)
    return JSONResponse({"input_tokens": len(prompt_ids)})


def stop_fields(finish_reason: str | None, stop_reason) -> dict:
    """Engine finish -> Anthropic's stop_reason / stop_sequence."""
    if finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


async def messages(request: Request):
    state = server_state(request)
    f, model, prompt_ids = await _prepare(request, state)
    max_tokens = f.int("max_tokens", None, lo=1)
    if max_tokens is None:
        raise invalid("'max_tokens' is required", param="max_tokens")
    stream = f.bool("stream")
    params = sampling_params(f, max_tokens=max_tokens, max_model_len=state.max_model_len,
                             stop_field="stop_sequences", model_defaults=state.model_defaults)
    state.check_prompt(prompt_ids, params, "messages")
    rid = new_id("msg_")
    deltas = stream_jobs(state.llm, [Job(rid, prompt_ids, params)], state.metrics)
    message = {"id": rid, "type": "message", "role": "assistant", "model": model}
    if stream:
        first = await first_delta(request, deltas)
        events = _message_events(request, message, first, deltas, len(prompt_ids))
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    c = (await until_disconnect(request, collect(deltas, 1, 1)))[0][0]
    return JSONResponse({**message, "content": [{"type": "text", "text": c.text}],
                         **stop_fields(c.finish_reason, c.stop_reason),
                         "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(c.token_ids)}})


async def _message_events(request, message, first, deltas, num_prompt_tokens):
    yield sse({"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": num_prompt_tokens, "output_tokens": 0}}}, "message_start")
    yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              "content_block_start")
    num_generated, last = 0, first[1]
    async with contextlib.aclosing(deltas):
        try:
            async for _, delta in with_first(first, deltas):
                num_generated += len(delta.new_token_ids)
                last = delta
                if delta.new_text:
                    yield sse({"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": delta.new_text}}, "content_block_delta")
        except APIError as e:
            yield sse(error_body(e, request.url.path), "error")
            return
    yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    yield sse({"type": "message_delta", "delta": stop_fields(last.finish_reason, last.stop_reason),
               "usage": {"output_tokens": num_generated}}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]

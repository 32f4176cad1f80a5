"""Anthropic-compatible routes: POST /v1/messages and /v1/messages/count_tokens.

The request (system + alternating user/assistant messages with text content) is rendered with
the model's chat template like an OpenAI chat. Streaming sends Anthropic's event sequence:
message_start, content_block_start, content_block_delta..., content_block_stop (per block),
message_delta (stop_reason, usage), message_stop. Errors use Anthropic's error shape
(errors.py picks it from the path).

Extended thinking: `thinking` {"type": "enabled" | "adaptive" | "disabled"} sets the template's
`enable_thinking` (Qwen3's switch). With `--reasoning-parser` an answer's `<think>` part comes back as a
`thinking` block before the text (anthropic_blocks.py); thinking blocks of earlier assistant turns are
dropped, as Anthropic drops them. `budget_tokens` (below max_tokens, as Anthropic requires) closes the
reasoning once the answer reaches it (serving/thinking_budget.py).
"""
from __future__ import annotations

import contextlib

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from serving.anthropic_blocks import BlockStream, content_blocks
from serving.bridge import Job, collect, first_delta, stream_jobs, until_disconnect, with_first
from serving.errors import APIError, error_body, invalid
from serving.protocol import Fields, sampling_params, text_content
from serving.state import SSE_HEADERS, ServerState, new_id, read_json, server_state, sse

UNSUPPORTED = ("tools", "tool_choice")
THINKING_TYPES = ("enabled", "adaptive", "disabled")
EARLIER_THINKING = ("thinking", "redacted_thinking")   # blocks of earlier assistant turns: dropped


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
        content = m.get("content")
        if m["role"] == "assistant" and isinstance(content, list):
            content = [b for b in content if not (isinstance(b, dict) and b.get("type") in EARLIER_THINKING)]
        out.append({"role": m["role"], "content": text_content(content, f"messages[{i}].content")})
    return out


def _thinking(f: Fields, state: ServerState) -> dict | None:
    """The request's `thinking`, checked; None when absent."""
    thinking = f.object("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise invalid(f"'thinking.type' must be one of {', '.join(THINKING_TYPES)}", param="thinking")
    if kind != "disabled" and state.reasoning_parser is None:
        raise invalid("'thinking' needs a server started with --reasoning-parser (qwen3 or deepseek_r1), "
                      "which splits the model's reasoning from its answer", param="thinking")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise invalid("'thinking.budget_tokens' must be a positive integer", param="thinking.budget_tokens")
    return thinking


async def _prepare(request: Request, state: ServerState) -> tuple[Fields, tuple, list[int], dict | None]:
    """(fields, (model, its LoRA adapter or None), prompt ids, thinking)"""
    f = Fields(await read_json(request))
    model, lora = state.generation_model(f)
    messages = _messages(f)
    thinking = _thinking(f, state)
    switch = {} if thinking is None else {"enable_thinking": thinking["type"] != "disabled"}
    # a last assistant message is a prefill: the answer continues it (Anthropic's behaviour)
    prompt_ids = await state.chat_prompt(messages, template_kwargs=switch,
                                         continue_final_message=messages[-1]["role"] == "assistant")
    return f, (model, lora), prompt_ids, thinking


async def count_tokens(request: Request) -> JSONResponse:
    state = server_state(request)
    _, _, prompt_ids, _ = await _prepare(request, state)
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
    f, (model, lora), prompt_ids, thinking = await _prepare(request, state)
    max_tokens = f.int("max_tokens", None, lo=1)
    if max_tokens is None:
        raise invalid("'max_tokens' is required", param="max_tokens")
    budget = thinking["budget_tokens"] if thinking and thinking["type"] == "enabled" else None   # checked
    if budget is not None and budget >= max_tokens:   # Anthropic's rule: the answer needs room too
        raise invalid(f"'thinking.budget_tokens' ({budget}) must be less than max_tokens ({max_tokens})",
                      param="thinking.budget_tokens")
    stream = f.bool("stream")
    params = sampling_params(f, max_tokens=max_tokens, max_model_len=state.max_model_len,
                             stop_field="stop_sequences", model_defaults=state.model_defaults)
    prompt_ids = params.truncated_prompt(prompt_ids, state.max_model_len)    # (vLLM's extra field)
    state.check_prompt(prompt_ids, params, "messages")
    rid, engine_id = new_id("msg_", request)
    job = Job(engine_id, prompt_ids, params, state.thinking_budget(budget, "thinking"), state.priority(f), lora)
    deltas = stream_jobs(state.llm, [job], state.metrics)
    message = {"id": rid, "type": "message", "role": "assistant", "model": model}
    if stream:
        first = await first_delta(request, deltas)
        events = _message_events(request, message, first, deltas, len(prompt_ids), state.reasoning_parser)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    c = (await until_disconnect(request, collect(deltas, 1, 1)))[0][0]
    return JSONResponse({**message, "content": content_blocks(c.text, state.reasoning_parser),
                         **stop_fields(c.finish_reason, c.stop_reason),
                         "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(c.token_ids)}})


async def _message_events(request, message, first, deltas, num_prompt_tokens, reasoning_parser):
    yield sse({"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": num_prompt_tokens, "output_tokens": 0}}}, "message_start")
    blocks = BlockStream(reasoning_parser)
    for event in blocks.start():
        yield event
    num_generated, last = 0, first[1]
    async with contextlib.aclosing(deltas):
        try:
            async for _, delta in with_first(first, deltas):
                num_generated += len(delta.new_token_ids)
                last = delta
                for event in blocks.add(delta.new_text):
                    yield event
        except APIError as e:
            yield sse(error_body(e, request.url.path), "error")
            return
    for event in blocks.finish():
        yield event
    yield sse({"type": "message_delta", "delta": stop_fields(last.finish_reason, last.stop_reason),
               "usage": {"output_tokens": num_generated}}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]

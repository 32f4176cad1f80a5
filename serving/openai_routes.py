"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each handler parses and validates the body (protocol.py), tokenizes, checks the length, turns
the request into bridge `Job`s and either collects the completions into one JSON response or
streams `chat.completion.chunk` / `text_completion` events as SSE, ending with `data: [DONE]`.
"""
from __future__ import annotations

import contextlib
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from serving.beam_requests import beam_params, run_beam_search
from serving.bridge import Job, collect, first_delta, stream_jobs, until_disconnect, with_first
from serving.errors import APIError, error_body, invalid
from serving.openai_shapes import CachedTokens, CompletionLogprobs, chat_logprobs, token_text, usage
from serving.lora_routes import lora_cards
from serving.protocol import (MAX_N, Fields, chat_render_options, completion_prompts,
                              sampling_params, text_content)
from atlasjax.sampling_params import MAX_LOGPROBS
from serving.reasoning import ReasoningStream, split_reasoning
from serving.state import SSE_HEADERS, ServerState, new_id, read_json, server_state, sse

CHAT_ROLES = ("system", "developer", "user", "assistant")


async def list_models(request: Request) -> JSONResponse:
    state = server_state(request)
    return JSONResponse({"object": "list", "data": [_model_card(state, name) for name in state.model_names]
                         + lora_cards(state)})


async def get_model(request: Request) -> JSONResponse:
    state = server_state(request)
    adapter = next((card for card in lora_cards(state) if card["id"] == request.path_params["model"]), None)
    if adapter is not None:
        return JSONResponse(adapter)
    if request.path_params["model"] not in state.model_names:
        raise APIError(404, f"the model '{request.path_params['model']}' does not exist", code="model_not_found")
    return JSONResponse(_model_card(state, request.path_params["model"]))


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "atlasjax",
            "root": state.model_names[0], "max_model_len": state.max_model_len}


# ---- /v1/chat/completions
def _chat_messages(f: Fields) -> list[dict]:
    messages = f.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"'messages[{i}]' must be an object", param="messages")
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls"):
            raise invalid("tools and function calling are not supported yet", param="messages")
        if role not in CHAT_ROLES:
            raise invalid(f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}", param="messages")
        content = m.get("content")
        text = "" if content is None and role == "assistant" else text_content(content, f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


def _reject_unsupported(f: Fields) -> None:
    if f.body.get("tools") or f.body.get("functions"):
        raise invalid("tools and function calling are not supported yet", param="tools")
    tool_choice = f.body.get("tool_choice")
    if tool_choice not in (None, "none"):
        raise invalid("tool_choice is not supported yet (only 'none')", param="tool_choice")
    fmt = f.object("response_format")
    if fmt is not None and fmt.get("type") != "text":
        raise invalid("structured outputs (response_format other than text) are not supported yet",
                      param="response_format")


def _include_usage(f: Fields, stream: bool, forced: bool = False) -> str | None:
    """A stream's usage: None, "final" (one chunk at the end: `include_usage`, or every stream with vLLM's
    --enable-force-include-usage: `forced`) or "continuous" (also on every chunk, counted so far: vLLM's
    `continuous_usage_stats` beside `include_usage`)."""
    options = f.object("stream_options")
    if options is None:
        return "final" if forced and stream else None
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    options = Fields(options)
    if not (options.bool("include_usage") or forced):
        return None
    return "continuous" if options.bool("continuous_usage_stats") else "final"


def _chunk_usage(include_usage: str | None, num_prompt_tokens: int, num_generated: int, cached) -> dict:
    """What each content chunk of a stream carries under its usage mode."""
    if include_usage == "continuous":
        return {"usage": usage(num_prompt_tokens, num_generated, cached.total)}
    return {"usage": None} if include_usage else {}


async def chat_completions(request: Request):
    state = server_state(request)
    f = Fields(await read_json(request))
    model, lora = state.generation_model(f)
    _reject_unsupported(f)
    messages = _chat_messages(f)
    n = f.int("n", 1, lo=1, hi=MAX_N)
    want_logprobs = f.bool("logprobs")
    as_ids = state.tokens_as_ids(f)
    top_k = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top_k is not None and not want_logprobs:
        raise invalid("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    max_tokens = f.int("max_completion_tokens", None, lo=1)
    max_tokens = f.int("max_tokens", None, lo=1) if max_tokens is None else max_tokens
    stream = f.bool("stream")
    include_usage = _include_usage(f, stream, state.force_include_usage)
    with_ids = f.bool("return_token_ids")
    prompt_logprobs = f.int("prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)    # vLLM's, not in a stream (as vLLM)
    if prompt_logprobs is not None and stream:
        raise invalid("'prompt_logprobs' is not available when 'stream' is true", param="prompt_logprobs")
    params = sampling_params(f, n=n, max_tokens=max_tokens, max_model_len=state.max_model_len,
                             logprobs=(top_k or 0) if want_logprobs else None, model_defaults=state.model_defaults,
                             prompt_logprobs=prompt_logprobs)
    prompt_ids = params.truncated_prompt(await state.chat_prompt(messages, **chat_render_options(f)),
                                         state.max_model_len)
    if max_tokens is None:
        params = state.default_max_tokens(params, prompt_ids)
    state.check_prompt(prompt_ids, params, "messages")
    budget = state.thinking_budget(f.int("thinking_token_budget", None, lo=1), "thinking_token_budget")
    rid, engine_id = new_id("chatcmpl-", request)
    if (beams := beam_params(f, n, params.max_tokens or state.max_model_len - len(prompt_ids))) is not None:
        outputs = await run_beam_search(request, state, [(engine_id, prompt_ids)], beams, state.priority(f), lora,
                                        state.cache_salt(f))
        choices = [{"index": i, "message": _message(seq.text, state.reasoning_parser), "logprobs": None,
                    "finish_reason": seq.finish_reason} for i, seq in enumerate(outputs[0].sequences)]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                             "choices": choices, "usage": usage(len(prompt_ids), _beam_tokens(outputs))})
    job = Job(engine_id, prompt_ids, params, budget, state.priority(f), lora, state.cache_salt(f))
    deltas = stream_jobs(state.llm, [job], state.metrics)
    head = {"id": rid, "created": int(time.time()), "model": model}
    if stream:
        first = await first_delta(request, deltas)
        events = _chat_events(request, head, first, deltas, n, len(prompt_ids), top_k or 0, want_logprobs,
                              include_usage, state.reasoning_parser, as_ids, prompt_ids if with_ids else None)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    completions = (await until_disconnect(request, collect(deltas, 1, n)))[0]
    choices = [{"index": i, "message": _message(c.text, state.reasoning_parser),
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, top_k or 0, as_ids) if want_logprobs else None,
                "finish_reason": c.finish_reason, **({"token_ids": c.token_ids} if with_ids else {})}
               for i, c in enumerate(completions)]
    num_generated = sum(len(c.token_ids) for c in completions)
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         **({"prompt_token_ids": prompt_ids} if with_ids else {}),
                         **({"prompt_logprobs": CompletionLogprobs.vllm_prompt_logprobs(completions[0].prompt_logprobs)}
                            if prompt_logprobs is not None else {}),
                         "usage": usage(len(prompt_ids), num_generated, completions[0].num_cached_tokens or 0)})


def _beam_tokens(outputs) -> int:
    """Completion tokens of a beam search: those of the sequences returned."""
    return sum(len(seq.output_token_ids) for out in outputs for seq in out.sequences)


def _message(text: str, reasoning_parser: str | None) -> dict:
    if reasoning_parser is None:
        return {"role": "assistant", "content": text}
    reasoning, content = split_reasoning(text, reasoning_parser)
    return {"role": "assistant", "content": content, "reasoning_content": reasoning}


def _text_delta(text: str, finished: bool, splitter: ReasoningStream | None) -> dict:
    """A chunk's delta: its text as content, or split into reasoning_content and content."""
    if splitter is None:
        return {"content": text} if text else {}
    reasoning, content = splitter.add(text)
    if finished:
        more_reasoning, more_content = splitter.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
    return {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {})}


async def _chat_events(request, head, first, deltas, n, num_prompt_tokens, top_k, want_logprobs, include_usage,
                       reasoning_parser=None, as_ids=False, prompt_ids=None):
    """prompt_ids: vLLM's `return_token_ids` (the first chunk names the prompt's token ids, each choice chunk its
    new ones)."""
    chunk = {**head, "object": "chat.completion.chunk"}
    with_ids = prompt_ids is not None
    num_generated, cached = 0, CachedTokens()
    splitters = [ReasoningStream(reasoning_parser) if reasoning_parser else None for _ in range(n)]
    async with contextlib.aclosing(deltas):
        for i in range(n):
            yield sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None,
                                             **({"token_ids": []} if with_ids else {})}],
                       **({"prompt_token_ids": prompt_ids} if with_ids and i == 0 else {}),
                       **_chunk_usage(include_usage, num_prompt_tokens, 0, cached)})
        try:
            async for j, delta in with_first(first, deltas):
                num_generated += len(delta.new_token_ids)
                cached.add(j, delta)
                text = _text_delta(delta.new_text, delta.finished, splitters[delta.index])
                if not (text or delta.finished or ((want_logprobs or with_ids) and delta.new_token_ids)):
                    continue
                choice = {"index": delta.index, "delta": text,
                          "logprobs": chat_logprobs(delta.new_token_ids, delta.new_logprobs or [], top_k, as_ids)
                          if want_logprobs else None,
                          "finish_reason": delta.finish_reason if delta.finished else None,
                          **({"token_ids": delta.new_token_ids} if with_ids else {})}
                yield sse({**chunk, "choices": [choice],
                           **_chunk_usage(include_usage, num_prompt_tokens, num_generated, cached)})
        except APIError as e:
            yield _sse_error(e, request)
            return
    if include_usage:
        yield sse({**chunk, "choices": [], "usage": usage(num_prompt_tokens, num_generated, cached.total)})
    yield "data: [DONE]\n\n"


# ---- /v1/completions
async def completions(request: Request):
    state = server_state(request)
    f = Fields(await read_json(request))
    model, lora = state.generation_model(f)
    prompts = completion_prompts(f)
    n = f.int("n", 1, lo=1, hi=MAX_N)
    if f.body.get("best_of") not in (None, n):
        raise invalid("'best_of' is not supported", param="best_of")
    logprobs = f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    echo = f.bool("echo")
    as_ids = state.tokens_as_ids(f)
    if f.str("suffix"):
        raise invalid("'suffix' is not supported", param="suffix")
    stream = f.bool("stream")
    include_usage = _include_usage(f, stream, state.force_include_usage)
    with_ids = f.bool("return_token_ids")
    # echo + logprobs: the prompt's own logprobs too (what evaluation harnesses score a text by); vLLM's
    # `prompt_logprobs` field asks for them in its own shape
    vllm_prompt_logprobs = f.int("prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    asked = [k for k in (logprobs if echo else None, vllm_prompt_logprobs) if k is not None]
    params = sampling_params(f, n=n, max_tokens=f.int("max_tokens", 16, lo=1), logprobs=logprobs,
                             max_model_len=state.max_model_len, prompt_logprobs=max(asked) if asked else None,
                             model_defaults=state.model_defaults)
    prompt_ids = [params.truncated_prompt(p if isinstance(p, list) else await state.encode(p), state.max_model_len)
                  for p in prompts]
    for ids in prompt_ids:
        state.check_prompt(ids, params, "prompt")
    rid, engine_id = new_id("cmpl-", request)
    priority, salt = state.priority(f), state.cache_salt(f)
    num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
    if (beams := beam_params(f, n, params.max_tokens)) is not None:
        outputs = await run_beam_search(request, state, [(engine_id if len(prompts) == 1 else f"{engine_id}-{i}", ids)
                                                         for i, ids in enumerate(prompt_ids)], beams, priority, lora,
                                        salt)
        choices = [{"index": j * n + i, "text": seq.text, "logprobs": None, "finish_reason": seq.finish_reason}
                   for j, out in enumerate(outputs) for i, seq in enumerate(out.sequences)]
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                             "choices": choices, "usage": usage(num_prompt_tokens, _beam_tokens(outputs))})
    jobs = [Job(engine_id if len(prompts) == 1 else f"{engine_id}-{i}", ids, params, priority=priority,
                lora_request=lora, cache_salt=salt)
            for i, ids in enumerate(prompt_ids)]
    deltas = stream_jobs(state.llm, jobs, state.metrics)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    echoes = [_echo(state, p if params.truncate_prompt_tokens is None else ids, ids, as_ids) if echo else None
              for p, ids in zip(prompts, prompt_ids)]
    if stream:
        first = await first_delta(request, deltas)
        events = _completion_events(request, head, first, deltas, n, echoes, logprobs, num_prompt_tokens,
                                    include_usage, vllm_prompt_logprobs is not None, as_ids,
                                    prompt_ids if with_ids else None)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    results = await until_disconnect(request, collect(deltas, len(jobs), n))
    choices = []
    for j, job_completions in enumerate(results):
        for i, c in enumerate(job_completions):
            text, lp = c.text, None
            if logprobs is not None:
                builder = CompletionLogprobs(as_ids=as_ids)
                lp = builder.prompt(echoes[j][1], echoes[j][2], c.prompt_logprobs, logprobs) if echoes[j] else None
                lp = CompletionLogprobs.merge(lp, builder.generated(c.token_ids, c.logprobs))
            if echoes[j]:
                text = echoes[j][0] + text
            choice = {"index": j * n + i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            if vllm_prompt_logprobs is not None:
                choice["prompt_logprobs"] = CompletionLogprobs.vllm_prompt_logprobs(c.prompt_logprobs)
            if with_ids:
                choice.update(prompt_token_ids=prompt_ids[j], token_ids=c.token_ids)
            choices.append(choice)
    num_generated = sum(len(c.token_ids) for job_completions in results for c in job_completions)
    cached = sum(job_completions[0].num_cached_tokens or 0 for job_completions in results)
    return JSONResponse({**head, "choices": choices, "usage": usage(num_prompt_tokens, num_generated, cached)})


def _echo(state: ServerState, prompt, ids: list[int], as_ids: bool = False) -> tuple[str, list[str], list[int]]:
    """(prompt text, per-token texts, token ids) echoed before a completion."""
    tok = state.tokenizer
    text = prompt if isinstance(prompt, str) else (tok.decode(ids) if tok else "")
    token_texts = [token_text(t, tok.decode([t], skip_special_tokens=False) if tok else None, as_ids) for t in ids]
    return text, token_texts, ids


async def _completion_events(request, head, first, deltas, n, echoes, logprobs, num_prompt_tokens,
                             include_usage, with_prompt_logprobs, as_ids=False, prompt_ids=None):
    """prompt_ids: vLLM's `return_token_ids` (each choice's first chunk names its prompt's token ids, every chunk
    its new ones)."""
    builders: dict[int, CompletionLogprobs] = {}
    num_generated, cached = 0, CachedTokens()
    with_ids, named_prompt = prompt_ids is not None, set()

    def token_ids(j, index, new_ids):
        if not with_ids:
            return {}
        if index in named_prompt:
            return {"token_ids": new_ids}
        named_prompt.add(index)
        return {"prompt_token_ids": prompt_ids[j], "token_ids": new_ids}

    def echo_event(j, index, entries=None):
        echo = echoes[j]
        lp = builders.setdefault(index, CompletionLogprobs(as_ids=as_ids)).prompt(echo[1], echo[2], entries, logprobs) \
            if logprobs is not None else None
        return sse({**head, "choices": [{"index": index, "text": echo[0], "logprobs": lp, "finish_reason": None,
                                          **token_ids(j, index, [])}],
                    **_chunk_usage(include_usage, num_prompt_tokens, num_generated, cached)})
    async with contextlib.aclosing(deltas):
        if logprobs is None:     # with logprobs, each echo waits for its prompt's logprobs (on the first delta)
            for j, echo in enumerate(echoes):
                for i in range(n if echo else 0):
                    yield echo_event(j, j * n + i)
        try:
            async for j, delta in with_first(first, deltas):
                num_generated += len(delta.new_token_ids)
                cached.add(j, delta)
                index = j * n + delta.index
                if logprobs is not None and echoes[j] and index not in builders:
                    yield echo_event(j, index, delta.prompt_logprobs)
                first_of_choice = with_prompt_logprobs and delta.prompt_logprobs is not None
                if not (delta.new_text or delta.finished or first_of_choice
                        or ((logprobs is not None or with_ids) and delta.new_token_ids)):
                    continue
                lp = None
                if logprobs is not None:
                    builder = builders.setdefault(index, CompletionLogprobs(as_ids=as_ids))
                    lp = builder.generated(delta.new_token_ids, delta.new_logprobs or [])
                choice = {"index": index, "text": delta.new_text, "logprobs": lp,
                          "finish_reason": delta.finish_reason if delta.finished else None,
                          **token_ids(j, index, delta.new_token_ids)}
                if first_of_choice:
                    choice["prompt_logprobs"] = CompletionLogprobs.vllm_prompt_logprobs(delta.prompt_logprobs)
                yield sse({**head, "choices": [choice],
                           **_chunk_usage(include_usage, num_prompt_tokens, num_generated, cached)})
        except APIError as e:
            yield _sse_error(e, request)
            return
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(num_prompt_tokens, num_generated, cached.total)})
    yield "data: [DONE]\n\n"


def _sse_error(err: APIError, request: Request) -> str:
    """An error after the headers went out: OpenAI clients raise on a data event holding "error"."""
    return sse(error_body(err, request.url.path))


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]

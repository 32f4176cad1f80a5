"""Operational routes: /health, /ping, /version, /load, /metrics, /tokenize, /detokenize, /reset_prefix_cache,
/openapi.json, and with --enable-sleep-mode /sleep, /wake_up, /is_sleeping (and SGLang's
/release_memory_occupation, /resume_memory_occupation).

/health, /ping, /version, /load and /openapi.json stay open when an API key is set; the others need it.
"""
from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from atlasjax import __version__
from serving.errors import engine_answer, invalid
from serving.openapi import openapi_schema
from serving.protocol import INT32_MAX, Fields, chat_render_options, check_model, text_content
from serving.state import read_json, server_state

OPEN_PATHS = {"/health", "/ping", "/version", "/openapi.json", "/load"}


def _engine_failure(state):
    """Why the engine (thread or process) stopped serving; None while it runs."""
    return None if state.llm.is_healthy else (state.llm.error or "the engine stopped")


async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    stats = state.llm.stats
    failure = _engine_failure(state)
    body = {"status": "ok" if failure is None else "error", "model": state.model_name,
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "kv_pages_free": stats.pages_free, "kv_pages_total": stats.pages_total}
    if failure is not None:
        body["error"] = repr(failure)
    replicas = getattr(state.llm, "replicas", None)   # data parallelism (atlasjax/data_parallel.py): each one's
    if replicas:
        body["replicas"] = [{"status": "ok" if r.is_healthy else "error", "num_running": s.num_running,
                             "num_waiting": s.num_waiting, "kv_pages_free": s.pages_free,
                             "kv_pages_total": s.pages_total} for r, s in zip(replicas, state.llm.replica_stats)]
    return JSONResponse(body, status_code=200 if failure is None else 503)


async def ping(request: Request) -> Response:
    """SageMaker's liveness probe, as vLLM serves it: /health's status, no body."""
    return Response(status_code=200 if _engine_failure(server_state(request)) is None else 503)


async def load(request: Request) -> JSONResponse:
    """vLLM's GET /load: the HTTP requests in progress (streams until their last event), probes aside, for a load
    balancer (vLLM counts them with --enable-server-load-tracking; this server always does)."""
    return JSONResponse({"server_load": server_state(request).metrics.server_load})


async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": __version__})


async def metrics(request: Request) -> Response:
    body, content_type = server_state(request).metrics.render()
    return Response(body, media_type=content_type)


async def tokenize(request: Request) -> JSONResponse:
    """{"prompt": text} or {"messages": [...]} (rendered with the chat template) -> token ids."""
    state = server_state(request)
    f = Fields(await read_json(request))
    check_model(f, state.model_names)
    if f.body.get("messages") is not None:
        messages = f.body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise invalid("'messages' must be a list of objects", param="messages")
        ids = await state.chat_prompt([{"role": m.get("role"), "content": text_content(
            m.get("content"), f"messages[{i}].content")} for i, m in enumerate(messages)],
            **chat_render_options(f))
    else:
        prompt = f.str("prompt", "")
        ids = await state.encode(prompt, f.bool("add_special_tokens", True))
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len})


async def detokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    f = Fields(await read_json(request))
    check_model(f, state.model_names)
    tokens = f.raw("tokens", [])
    vocab = state.vocab_size
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < min(vocab, INT32_MAX) for t in tokens):
        raise invalid(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    tok = state.require_tokenizer()
    text = await asyncio.to_thread(tok.decode, tokens, f.bool("skip_special_tokens", False))
    return JSONResponse({"prompt": text})


async def reset_prefix_cache(request: Request) -> Response:
    """vLLM's POST /reset_prefix_cache: cached prompt pages no running request holds are forgotten before
    any later request is admitted (benchmarks measure cold prompts with it)."""
    server_state(request).llm.reset_prefix_cache()
    return Response(status_code=200)


async def sleep(request: Request) -> Response:
    """vLLM's POST /sleep?level=1|2 (with --enable-sleep-mode): the engine releases its device memory
    (atlasjax/sleep_mode.py); 400 while requests are in flight."""
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise invalid(f"'level' must be 1 or 2, got {level!r}", param="level")
    await engine_answer(server_state(request).llm.sleep(int(level)))
    return Response(status_code=200)


async def wake_up(request: Request) -> Response:
    """vLLM's POST /wake_up[?tags=weights&tags=kv_cache]: take back what /sleep released."""
    tags = request.query_params.getlist("tags") or None
    await engine_answer(server_state(request).llm.wake_up(tags))
    return Response(status_code=200)


SGLANG_TAGS = ("weights", "kv_cache", "cuda_graph")   # cuda_graph: nothing of ours to release (XLA's executables)


def _sglang_tags(f: Fields) -> list[str]:
    tags = f.raw("tags", list(SGLANG_TAGS))
    if not isinstance(tags, list) or not tags or any(t not in SGLANG_TAGS for t in tags):
        raise invalid(f"'tags' must be a non-empty list among {', '.join(SGLANG_TAGS)}", param="tags")
    return [t for t in tags if t != "cuda_graph"]


async def release_memory_occupation(request: Request) -> JSONResponse:
    """SGLang's POST /release_memory_occupation {"tags": [...]} (with --enable-sleep-mode): /sleep?level=1, the
    weights kept in host memory. The weights and the KV cache go together: one alone is refused."""
    tags = _sglang_tags(Fields(await read_json(request)))
    if sorted(tags) != ["kv_cache", "weights"]:
        raise invalid("releasing the weights or the KV cache alone is not supported: send both tags (or none)",
                      param="tags")
    await engine_answer(server_state(request).llm.sleep(1))
    return JSONResponse({"success": True, "message": "released"})


async def resume_memory_occupation(request: Request) -> JSONResponse:
    """SGLang's POST /resume_memory_occupation {"tags": [...]}: /wake_up for those tags (default: all)."""
    tags = _sglang_tags(Fields(await read_json(request)))
    await engine_answer(server_state(request).llm.wake_up(tags or None))
    return JSONResponse({"success": True, "message": "resumed"})


async def is_sleeping(request: Request) -> JSONResponse:
    return JSONResponse({"is_sleeping": await engine_answer(server_state(request).llm.is_sleeping())})


async def start_profile(request: Request) -> JSONResponse:
    """vLLM's POST /start_profile (a server started with --profiler-dir): trace the engine from now
    (atlasjax/profiling.py); 400 while a trace is being taken."""
    directory = await engine_answer(server_state(request).llm.start_profile())
    return JSONResponse({"status": "profiling", "directory": directory})


async def stop_profile(request: Request) -> JSONResponse:
    """vLLM's POST /stop_profile: end the trace and write it (XProf's *.xplane.pb, perfetto_trace.json.gz)."""
    directory = await engine_answer(server_state(request).llm.stop_profile())
    return JSONResponse({"status": "written", "directory": directory})


async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(openapi_schema())


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/ping", ping, methods=["GET", "POST"]),
    Route("/version", version, methods=["GET"]),
    Route("/load", load, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
PROFILE_ROUTES = [   # only with --profiler-dir or $ATLASJAX_PROFILER_DIR (vLLM's: with its profiler directory set)
    Route("/start_profile", start_profile, methods=["POST"]),
    Route("/stop_profile", stop_profile, methods=["POST"]),
]
SLEEP_ROUTES = [   # only with --enable-sleep-mode (vLLM serves them in its dev mode)
    Route("/sleep", sleep, methods=["POST"]),
    Route("/wake_up", wake_up, methods=["POST"]),
    Route("/is_sleeping", is_sleeping, methods=["GET"]),
    Route("/release_memory_occupation", release_memory_occupation, methods=["POST"]),
    Route("/resume_memory_occupation", resume_memory_occupation, methods=["POST"]),
]

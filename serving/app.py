"""The ASGI app: routes, middleware and error handlers around one AsyncLLM.

    app = create_app(AsyncLLM(model), served_model_name="my-model", api_key="secret")

Handlers live in openai_routes.py, anthropic_routes.py, generate_routes.py (SGLang's native API) and
utility_routes.py; they reach the engine through `app.state.server` (state.py) and the bridge
(bridge.py). Every error, raised by
a handler, the router (404/405) or a middleware (401/413), leaves in the error shape of the
API its path belongs to; an unexpected exception is logged and answered 500 in that shape, and
the server keeps serving.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response

from serving import (anthropic_routes, embeddings_routes, generate_routes, invocations, lora_routes, openai_routes,
                     responses_routes, utility_routes, weight_routes)
from serving.bridge import ClientDisconnected
from serving.errors import APIError, error_response
from serving.metrics import ServerMetrics
from serving.response_store import DEFAULT_MAX_STORED, ResponseStore
from serving.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware, RequestMetricsMiddleware
from serving.state import ServerState
from serving.stats_log import StatsLogger

log = logging.getLogger("atlasjax.serving")

DEFAULT_MAX_BODY_BYTES = 8 << 20
CLIENT_CLOSED_REQUEST = 499      # nginx's status for "the client went away"; only metrics see it


async def _api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc, request.url.path)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return error_response(APIError(exc.status_code, message, headers=exc.headers), request.url.path)


async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}"), request.url.path)


def create_app(engine, *, served_model_name: str | list[str], api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, cors_origins: list[str] | None = None,
               reasoning_parser: str | None = None, return_tokens_as_token_ids: bool = False,
               max_stored_responses: int = DEFAULT_MAX_STORED, log_stats_interval: float = 0.0,
               enable_sleep_mode: bool = False, lora_modules: dict | None = None,
               enable_profiler: bool = False, enable_weight_updates: bool = False,
               incremental_streaming_output: bool = False, force_include_usage: bool = False) -> Starlette:
    """Build the server app.

    Args:
      engine: a running atlasjax.AsyncLLM, or an EngineProcessLLM (atlasjax/engine_process.py); the
        caller owns it and shuts it down.
      served_model_name: the values accepted in requests' "model" field: one name, or several (vLLM's
        `--served-model-name a b`: /v1/models lists each, the first is the default).
      api_key: when set, every route except /health and /openapi.json needs it.
      max_body_bytes: larger request bodies get 413.
      cors_origins: allowed browser origins; None or empty disables CORS.
      reasoning_parser: "qwen3" or "deepseek_r1": chat answers' <think> part goes to `reasoning_content`
        (serving/reasoning.py); None: all of the text is content.
      return_tokens_as_token_ids: logprob entries name tokens `token_id:N` by default (a request's own
        `return_tokens_as_token_ids` field still decides for it).
      incremental_streaming_output: /generate streams send each sequence's new text, ids and logprobs per event
        (SGLang's flag) instead of the whole answer so far.
      force_include_usage: every /v1/completions and /v1/chat/completions stream ends with a usage chunk, as if
        it asked `stream_options.include_usage` (vLLM's --enable-force-include-usage).
      max_stored_responses: Responses API answers kept in memory for GET /v1/responses/{id} and
        `previous_response_id` (least recently used out first; 0 keeps none).
      log_stats_interval: seconds between the engine's stats lines in the log (serving/stats_log.py; 0: none).
      enable_sleep_mode: serve /sleep, /wake_up and /is_sleeping (vLLM's, for RL loops sharing the devices).
      lora_modules: {name: LoRARequest} (`serve --lora-modules`): adapters a generation request's "model" may name
        (the engine needs enable_lora; serving/lora_routes.py). With LoRA enabled and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, /v1/load_lora_adapter and /v1/unload_lora_adapter change them.
      enable_profiler: serve /start_profile and /stop_profile (the engine needs a profiler directory:
        atlasjax/profiling.py).
      enable_weight_updates: serve the routes an RL loop gives the engine new weights by (serving/weight_routes.py:
        vLLM's /pause, /resume, /is_paused; SGLang's /update_weights_from_disk and its pause routes).
    """
    max_lora_rank = _max_lora_rank(engine)
    if lora_modules and max_lora_rank is None:
        raise ValueError("LoRA modules need an engine with LoRA enabled (enable_lora=True / --enable-lora)")
    metrics = ServerMetrics(engine)
    routes = (openai_routes.ROUTES + responses_routes.ROUTES + embeddings_routes.ROUTES + anthropic_routes.ROUTES
              + invocations.ROUTES + generate_routes.ROUTES
              + utility_routes.ROUTES + (utility_routes.SLEEP_ROUTES if enable_sleep_mode else [])
              + (utility_routes.PROFILE_ROUTES if enable_profiler else [])
              + (weight_routes.ROUTES if enable_weight_updates else [])
              + (lora_routes.ROUTES if max_lora_rank is not None and lora_routes.runtime_updates_allowed() else []))
    known_paths = {r.path for r in routes if "{" not in r.path}
    middleware = []
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                     allow_methods=["GET", "POST", "DELETE"],
                                     allow_headers=["*"], expose_headers=["X-Request-Id"]))
    middleware.append(Middleware(RequestIdMiddleware))
    middleware.append(Middleware(RequestMetricsMiddleware, metrics=metrics, known_paths=known_paths))
    if api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=api_key, open_paths=utility_routes.OPEN_PATHS))
    middleware.append(Middleware(BodyLimitMiddleware, max_bytes=max_body_bytes))
    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(StatsLogger(engine, log_stats_interval).run()) if log_stats_interval > 0 else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, ClientDisconnected: _disconnected, Exception: _unexpected})
    app.state.server = ServerState(engine, served_model_name, metrics, reasoning_parser=reasoning_parser,
                                   return_tokens_as_token_ids=return_tokens_as_token_ids,
                                   incremental_streaming_output=incremental_streaming_output,
                                   force_include_usage=force_include_usage,
                                   responses=ResponseStore(max_stored_responses),
                                   lora_modules=dict(lora_modules or {}), max_lora_rank=max_lora_rank)
    return app


def _max_lora_rank(engine) -> int | None:
    """The engine's max_lora_rank with LoRA enabled, else None (an AsyncLLM's engine, or an engine process's info)."""
    config = getattr(engine.engine, "config", None)
    return config.max_lora_rank if config is not None and config.enable_lora else None

"""Routes an RL loop drives the server with between rollouts (`serve --enable-weight-updates`): pause generation,
give the engine new weights from disk, resume (atlasjax/pause.py, atlasjax/weight_update.py).

vLLM's: POST /pause?mode=abort|wait|keep&clear_cache=true|false, POST /resume, GET /is_paused.
SGLang's: POST /update_weights_from_disk {"model_path", "abort_all_requests", "weight_version"},
GET /get_weight_version, POST /pause_generation {"mode": "abort" | "retract" | "in_place"}, POST /continue_generation.
"""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from atlasjax.errors import AtlasJaxError
from atlasjax.pause import MODES
from serving.errors import engine_answer, invalid
from serving.protocol import Fields
from serving.state import read_json, server_state

# SGLang's pause modes as ours: "retract" gives the requests' pages back (they compute them again at resume),
# "in_place" keeps them.
SGLANG_MODES = {"abort": ("abort", True), "retract": ("keep", True), "in_place": ("keep", False)}


def _query_bool(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise invalid(f"'{name}' must be true or false, got {value!r}", param=name)
    return value.lower() in ("true", "1")


async def pause(request: Request) -> JSONResponse:
    """vLLM's POST /pause: answered once the pause has taken effect ("wait": once the requests in flight have
    finished). `wait_for_inflight_requests=true` (vLLM's earlier form) is mode=wait."""
    default = "wait" if _query_bool(request, "wait_for_inflight_requests", False) else "abort"
    mode = request.query_params.get("mode", default)
    if mode not in MODES:
        raise invalid(f"'mode' must be one of {', '.join(MODES)}, got {mode!r}", param="mode")
    return await _pause(request, mode, _query_bool(request, "clear_cache", True))


async def _pause(request: Request, mode: str, clear_cache: bool) -> JSONResponse:
    paused = await engine_answer(server_state(request).llm.pause_generation(mode, clear_cache))
    return JSONResponse({"status": "paused" if paused else "resumed before the pause took effect"})


async def resume(request: Request) -> JSONResponse:
    await engine_answer(server_state(request).llm.resume_generation())
    return JSONResponse({"status": "resumed"})


async def is_paused(request: Request) -> JSONResponse:
    return JSONResponse({"is_paused": await engine_answer(server_state(request).llm.is_paused())})


async def pause_generation(request: Request) -> JSONResponse:
    """SGLang's POST /pause_generation {"mode": "abort" | "retract" | "in_place"} (default abort)."""
    f = Fields(await read_json(request))
    mode = f.str("mode", "abort")
    if mode not in SGLANG_MODES:
        raise invalid(f"'mode' must be one of {', '.join(SGLANG_MODES)}, got {mode!r}", param="mode")
    return await _pause(request, *SGLANG_MODES[mode])


async def update_weights_from_disk(request: Request) -> JSONResponse:
    """SGLang's POST /update_weights_from_disk: the checkpoint at `model_path` (same architecture) replaces the
    weights. On a paused engine it loads at once; otherwise the requests in flight finish first (or end now, with
    `abort_all_requests`), later ones wait, and generation resumes on the new weights. A checkpoint that cannot be
    read, or of another architecture: 400 {"success": false, "message"}, the old weights serving on."""
    state = server_state(request)
    f = Fields(await read_json(request))
    model_path = f.str("model_path", None)
    if not model_path:
        raise invalid("'model_path' (the checkpoint to load) is required", param="model_path")
    abort = f.bool("abort_all_requests", False)
    version = f.raw("weight_version", None)
    if version is not None and not isinstance(version, str):
        raise invalid("'weight_version' must be a string", param="weight_version")
    llm = state.llm
    async with state.weights_lock:
        was_paused = await engine_answer(llm.is_paused())
        t0 = time.perf_counter()
        try:
            if not was_paused:
                await engine_answer(llm.pause_generation("abort" if abort else "wait", False))
            try:
                loaded = await llm.update_weights_from_disk(model_path)
            finally:
                if not was_paused:
                    await engine_answer(llm.resume_generation())
        except (AtlasJaxError, RuntimeError) as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        if version is not None:
            state.weight_version = version
    return JSONResponse({"success": True, "weight_version": state.weight_version,
                         "message": f"loaded {model_path} in {loaded['seconds']:.2f} s "
                                    f"({time.perf_counter() - t0:.2f} s with the pause)"})


async def get_weight_version(request: Request) -> JSONResponse:
    return JSONResponse({"weight_version": server_state(request).weight_version})


ROUTES = [
    Route("/pause", pause, methods=["POST"]),
    Route("/resume", resume, methods=["POST"]),
    Route("/is_paused", is_paused, methods=["GET"]),
    Route("/pause_generation", pause_generation, methods=["POST"]),
    Route("/continue_generation", resume, methods=["POST"]),
    Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
    Route("/get_weight_version", get_weight_version, methods=["GET"]),
]

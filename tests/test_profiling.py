"""Device traces of the engine (atlasjax/profiling.py), as vLLM's start_profile / stop_profile.

What a user sees: after `LLM.start_profile()` ... `stop_profile()` (or POST /start_profile, /stop_profile on a
server given --profiler-dir) the trace files are in the directory, in the formats XProf and Perfetto open, and
they show the engine's steps; misuse (no directory, stopping twice) is a clear error that leaves the engine
serving.
"""
from __future__ import annotations

import asyncio
import glob
import gzip
import json
import os

import httpx
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.errors import InvalidRequestError
from tests.server_util import ENGINE_KWARGS, MODEL_NAME, tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _trace_files(directory: str) -> dict[str, list[str]]:
    runs = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*")))
    assert runs, f"no trace under {directory}"
    return {kind: glob.glob(os.path.join(runs[-1], pattern))
            for kind, pattern in (("xplane", "*.xplane.pb"), ("perfetto", "perfetto_trace.json.gz"))}


def test_a_profile_records_the_engine_steps(tmp_path_factory, tmp_path):
    llm = LLM(tiny_model_dir(tmp_path_factory), profiler_dir=str(tmp_path / "traces"), **ENGINE_KWARGS)
    with pytest.raises(InvalidRequestError, match="no profile is being taken"):
        llm.stop_profile()
    assert llm.start_profile() == str(tmp_path / "traces")
    with pytest.raises(InvalidRequestError, match="already being taken"):
        llm.start_profile()
    out = llm.generate("The capital of France is", GREEDY)
    assert llm.stop_profile() == str(tmp_path / "traces")
    files = _trace_files(str(tmp_path / "traces"))
    assert len(files["xplane"]) == 1 and os.path.getsize(files["xplane"][0]) > 0
    with gzip.open(files["perfetto"][0], "rt") as f:
        events = json.load(f)
    names = {e.get("name", "") for e in (events["traceEvents"] if isinstance(events, dict) else events)}
    assert any("step" in n or "jit" in n for n in names), sorted(names)[:50]    # the engine's programs ran in it
    assert llm.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    elsewhere = str(tmp_path / "named")            # a directory named on the call
    assert llm.start_profile(elsewhere) == elsewhere
    llm.stop_profile()
    assert _trace_files(elsewhere)["xplane"]


def test_without_a_directory_start_profile_says_how_to_give_one(tmp_path_factory, monkeypatch):
    from atlasjax.profiling import ENV, Profiler, profiler_dir
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(InvalidRequestError, match="--profiler-dir"):
        Profiler(profiler_dir(None)).start()
    monkeypatch.setenv(ENV, "~/traces")
    assert profiler_dir(None) == os.path.expanduser("~/traces")


def test_the_server_routes_start_and_stop_a_profile(tmp_path_factory, tmp_path):
    from atlasjax import AsyncLLM
    from serving.app import create_app
    llm = AsyncLLM(tiny_model_dir(tmp_path_factory), profiler_dir=str(tmp_path), **ENGINE_KWARGS)
    try:
        async def go():
            with_routes = create_app(llm, served_model_name=MODEL_NAME, enable_profiler=True)
            without = create_app(llm, served_model_name=MODEL_NAME)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_routes), base_url="http://t") as c:
                started = await c.post("/start_profile")
                done = await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
                stopped = await c.post("/stop_profile")
                again = await c.post("/stop_profile")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=without), base_url="http://t") as c:
                absent = await c.post("/start_profile")
            return started, done, stopped, again, absent
        started, done, stopped, again, absent = asyncio.run(go())
        assert started.status_code == 200 and started.json() == {"status": "profiling", "directory": str(tmp_path)}
        assert done.status_code == 200
        assert stopped.status_code == 200 and stopped.json()["directory"] == str(tmp_path)
        assert again.status_code == 400 and "no profile" in again.json()["error"]["message"]
        assert absent.status_code == 404
        assert _trace_files(str(tmp_path))["perfetto"]
    finally:
        llm.shutdown()

"""Server options a load balancer or client library relies on, in process on a scripted engine
(tests/test_reasoning.py): vLLM's GET /load and --enable-force-include-usage, SGLang's /health_generate."""
from __future__ import annotations

import asyncio
import json

import httpx

from serving.app import create_app
from tests.server_util import MODEL_NAME, post_in_process, sse_events
from tests.test_reasoning import ScriptedLLM


class GatedLLM(ScriptedLLM):
    """Holds every answer until `gate` is set."""

    def __init__(self, pieces):
        super().__init__(pieces)
        self.gate = asyncio.Event()

    async def generate(self, *args, **kwargs):
        await self.gate.wait()
        async for delta in super().generate(*args, **kwargs):
            yield delta


def test_load_counts_the_requests_in_progress_and_not_the_probes():
    async def go():
        llm = GatedLLM(["a", "b"])
        app = create_app(llm, served_model_name=MODEL_NAME, api_key="secret")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            async def load():
                r = await client.get("/load")        # open: no API key needed, as /health
                assert r.status_code == 200
                return r.json()["server_load"]
            assert await load() == 0
            body = {"prompt": "Hi", "max_tokens": 2, "stream": True}
            headers = {"Authorization": "Bearer secret"}
            requests = [asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))
                        for _ in range(3)]
            for _ in range(200):
                if await load() == 3:
                    break
                await asyncio.sleep(0.01)
            assert await load() == 3
            await client.get("/version")
            assert await load() == 3
            llm.gate.set()
            assert all(r.status_code == 200 for r in await asyncio.gather(*requests))
            assert await load() == 0
    asyncio.run(go())


def _stream_chunks(force: bool, body: dict, path: str = "/v1/completions") -> list[dict]:
    app = create_app(ScriptedLLM(["a", "b"]), served_model_name=MODEL_NAME, force_include_usage=force)
    r = post_in_process(app, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    return sse_events(r.text.splitlines())


def test_force_include_usage_ends_every_stream_with_its_usage():
    completion = {"prompt": "Hi", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert all("usage" not in c for c in _stream_chunks(False, completion))
    for body, path in ((completion, "/v1/completions"), (chat, "/v1/chat/completions")):
        last = _stream_chunks(True, body, path)[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    continuous = _stream_chunks(True, {**completion, "stream_options": {"continuous_usage_stats": True}})
    assert all(c["usage"] is not None for c in continuous)


def test_health_generate_answers_503_when_no_token_comes(monkeypatch):
    """SGLang's /health_generate: 200 once a token is generated; 503 when none comes in time (a paused engine)."""
    from serving import generate_routes
    monkeypatch.setattr(generate_routes, "HEALTH_GENERATE_TIMEOUT_S", 0.3)

    async def go(llm):
        app = create_app(llm, served_model_name=MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/health_generate")
    assert asyncio.run(go(ScriptedLLM(["ok"]))).status_code == 200
    r = asyncio.run(go(GatedLLM(["ok"])))          # its gate never opens
    assert r.status_code == 503 and "no token within" in r.json()["error"]

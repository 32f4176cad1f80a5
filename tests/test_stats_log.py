"""The periodic stats line (`serve --log-stats-interval`): throughputs over the interval, the engine's state
now, quiet when idle; and on a live server (the engine in its own process), a line with the tokens it made."""
from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest

from atlasjax.metrics import EngineStats
from serving.stats_log import StatsLogger
from tests.server_util import API_KEY, MODEL_NAME, engine_process_server


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return engine_process_server(request, tmp_path_factory)


def test_lines_report_the_interval_and_stay_quiet_when_idle():
    stats = EngineStats(pages_total=100, pages_free=100)
    logger = StatsLogger(SimpleNamespace(stats=stats), interval=2.0)
    logger._last = (0.0, 0, 0)
    assert logger.line(2.0) is None                                   # idle from the start: nothing
    stats.prompt_tokens, stats.generation_tokens, stats.num_running, stats.pages_free = 300, 50, 3, 75
    stats.prefix_cache_queries, stats.prefix_cache_hits = 4, 1
    assert logger.line(4.0) == ("prompt throughput 150.0 tokens/s, generation throughput 25.0 tokens/s, running 3, "
                                "waiting 0, KV cache 25.0% used, prefix cache hit rate 25.0%")
    stats.num_running, stats.pages_free = 0, 100
    assert logger.line(6.0).startswith("prompt throughput 0.0 tokens/s, generation throughput 0.0 tokens/s, running 0")
    assert logger.line(8.0) is None                                   # one idle line, then quiet


def test_a_live_server_logs_the_tokens_it_generated(server):
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL_NAME, "prompt": "Count with me", "max_tokens": 8, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in server.log().splitlines() if "generation throughput" in line]
        if any("generation throughput 0.0 " not in line for line in lines):
            return
        time.sleep(0.2)
    raise AssertionError(f"no stats line with generated tokens:\n{server.log()[-2000:]}")

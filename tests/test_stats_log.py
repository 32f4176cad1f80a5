"""The periodic stats line (`serve --log-stats-interval`): throughputs over the interval, the engine's state
now, quiet when idle. (tests/test_engine_process.py checks a live server's lines.)"""
from __future__ import annotations

from types import SimpleNamespace

from atlasjax.metrics import EngineStats
from serving.stats_log import StatsLogger


def test_lines_report_the_interval_and_stay_quiet_when_idle():
    stats = EngineStats(pages_total=100, pages_free=100)
    logger = StatsLogger(SimpleNamespace(stats=stats), interval=2.0)
    logger._last = (0.0, 0, 0, 0)
    assert logger.line(2.0) is None                                   # idle from the start: nothing
    stats.prompt_tokens, stats.generation_tokens, stats.num_running, stats.pages_free = 300, 50, 3, 75
    stats.prefix_cache_queries, stats.prefix_cache_hits = 4, 1
    assert logger.line(4.0) == ("prompt throughput 150.0 tokens/s, generation throughput 25.0 tokens/s, running 3, "
                                "waiting 0, KV cache 25.0% used, prefix cache hit rate 25.0%")
    stats.num_running, stats.pages_free = 0, 100
    assert logger.line(6.0).startswith("prompt throughput 0.0 tokens/s, generation throughput 0.0 tokens/s, running 0")
    assert logger.line(8.0) is None                                   # one idle line, then quiet


def test_an_interval_that_embedded_reports_its_embedding_throughput():
    stats = EngineStats(pages_total=100, pages_free=100)
    logger = StatsLogger(SimpleNamespace(stats=stats), interval=2.0)
    logger._last = (0.0, 0, 0, 0)
    stats.embedding_tokens = 4096
    assert logger.line(2.0) == ("prompt throughput 0.0 tokens/s, generation throughput 0.0 tokens/s, embedding "
                                "throughput 2048.0 tokens/s, running 0, waiting 0, KV cache 0.0% used, prefix cache "
                                "hit rate 0.0%")
    assert "embedding" not in logger.line(4.0)                        # the idle line after it
    assert logger.line(6.0) is None


def test_an_interval_that_drafted_reports_the_drafts_acceptance():
    stats = EngineStats(pages_total=100, pages_free=100)
    logger = StatsLogger(SimpleNamespace(stats=stats), interval=2.0)
    logger._last = (0.0, 0, 0, 0)
    stats.generation_tokens, stats.num_running = 40, 1
    stats.spec.record(4, 3)
    stats.spec.record(4, 1)
    assert ", drafts accepted 50.0% (mean acceptance length 3.00), running 1" in logger.line(2.0)
    stats.generation_tokens = 50                     # an interval that drafted nothing: no such part
    assert "drafts" not in logger.line(4.0)

"""The engine's state in the server log every few seconds (vLLM's stats logger; `serve
--log-stats-interval S`, 10 by default, `--disable-log-stats` off), on the `atlasjax.stats` logger at INFO:

    prompt throughput 1520.3 tokens/s, generation throughput 210.7 tokens/s, running 6, waiting 0,
    KV cache 12.5% used, prefix cache hit rate 43.0%

Throughputs are over the interval (prompt tokens computed, cache hits not counted; embedded tokens, when an
interval embedded any: `, embedding throughput 8192.0 tokens/s` follows the generation figure; with speculative
decoding, when it drafted: `, drafts accepted 61.2% (mean acceptance length 2.8)`); the rest is
read now, the hit rate over the server's life. A line is written while requests run or wait or tokens
moved, and once more when the server turns idle; an idle server stays quiet.
"""
from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("atlasjax.stats")


class StatsLogger:
    def __init__(self, llm, interval: float):
        self.llm, self.interval = llm, interval
        stats = llm.stats
        self._last = (time.monotonic(), stats.prompt_tokens, stats.generation_tokens, stats.embedding_tokens)
        self._spec = (stats.spec.num_drafts, stats.spec.num_draft_tokens, stats.spec.num_accepted_tokens)
        self._was_busy = False

    def line(self, now: float) -> str | None:
        """The line for the interval ending now (None: idle then and before)."""
        stats = self.llm.stats     # (an engine thread's stats are refreshed on each read: read them once)
        then, prompt0, gen0, emb0 = self._last
        prompt1, gen1, emb1 = stats.prompt_tokens, stats.generation_tokens, stats.embedding_tokens
        self._last = (now, prompt1, gen1, emb1)
        busy = bool(stats.num_running or stats.num_waiting or prompt1 > prompt0 or gen1 > gen0 or emb1 > emb0)
        if not (busy or self._was_busy):
            return None
        self._was_busy = busy
        seconds = max(now - then, 1e-9)
        embedded = f", embedding throughput {(emb1 - emb0) / seconds:.1f} tokens/s" if emb1 > emb0 else ""
        return (f"prompt throughput {(prompt1 - prompt0) / seconds:.1f} tokens/s, generation throughput "
                f"{(gen1 - gen0) / seconds:.1f} tokens/s{embedded}{self._spec_part(stats.spec)}, "
                f"running {stats.num_running}, "
                f"waiting {stats.num_waiting}, "
                f"KV cache {100 * stats.kv_cache_usage:.1f}% used, "
                f"prefix cache hit rate {100 * stats.prefix_cache_hit_rate:.1f}%")

    def _spec_part(self, spec) -> str:
        """The interval's draft acceptance ('' when it drafted nothing)."""
        now = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        (d0, t0, a0), self._spec = self._spec, now
        drafts, tokens, accepted = now[0] - d0, now[1] - t0, now[2] - a0
        if not tokens:
            return ""
        return f", drafts accepted {100 * accepted / tokens:.1f}% (mean acceptance length {1 + accepted / drafts:.2f})"

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if (text := self.line(time.monotonic())) is not None:
                log.info(text)

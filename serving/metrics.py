"""Prometheus metrics for one app: its own registry, HTTP/token/latency series, engine gauges.

Request handlers feed the counters and histograms (through the bridge); engine state is read
at scrape time by `EngineCollector` from `llm.stats`: an in-process engine's gauges are read at
that moment (they change on abort even when no step runs); an engine process's are those of its
latest message (atlasjax/engine_process.py).
"""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineCollector(Collector):
    def __init__(self, llm):
        self.llm = llm

    def collect(self):
        stats = self.llm.stats
        gauges = (
            ("atlasjax_num_requests_running", "Sequences holding a batch slot", stats.num_running),
            ("atlasjax_num_requests_waiting", "Sequences waiting for a slot", stats.num_waiting),
            ("atlasjax_kv_pages_used", "KV cache pages in use", stats.pages_total - stats.pages_free),
            ("atlasjax_kv_pages_free", "KV cache pages free (cached prefixes included)", stats.pages_free),
            ("atlasjax_kv_pages_total", "KV cache pages in the pool", stats.pages_total),
            ("atlasjax_prefix_cache_hit_rate", "Prefix cache hits / queries, in pages", stats.prefix_cache_hit_rate),
            ("atlasjax_kv_cache_usage_perc", "Fraction of the KV page pool in use (1 = full)",
             stats.kv_cache_usage),
            ("atlasjax_kv_offload_pages", "KV pages held in host memory (--kv-offloading-size)",
             stats.kv_offload_pages),
            ("atlasjax_kv_offload_pages_total", "KV pages host memory holds at most (0: offloading off)",
             stats.kv_offload_capacity),
            ("atlasjax_kv_offload_disk_pages", "KV pages held in files (--kv-offloading-disk)",
             stats.kv_offload_disk_pages),
            ("atlasjax_kv_offload_disk_pages_total", "KV pages the files may hold at most (0: no disk tier)",
             stats.kv_offload_disk_capacity),
            ("atlasjax_kv_offload_disk_reading_pages", "KV pages being read from files now (their requests wait)",
             stats.kv_offload_disk_reading),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = (
            ("atlasjax_prefix_cache_queries", "Full prompt pages looked up in the prefix cache",
             stats.prefix_cache_queries),
            ("atlasjax_prefix_cache_hits", "Prompt pages served by the prefix cache", stats.prefix_cache_hits),
            ("atlasjax_kv_offload_hits", "Prompt pages copied back from host memory (among the prefix cache hits)",
             stats.kv_offload_hits),
            ("atlasjax_kv_offload_saved", "Evicted KV pages copied to host memory", stats.kv_offload_saved),
            ("atlasjax_kv_offload_disk_reads", "KV pages read back from files (among the host-memory hits)",
             stats.kv_offload_disk_reads),
            ("atlasjax_num_preemptions", "Sequences preempted for lack of KV pages", stats.num_preemptions),
            ("atlasjax_engine_steps", "Engine steps run", stats.num_steps),
            ("atlasjax_embedding_inputs", "Inputs embedded or classified", stats.num_embedding_inputs),
            ("atlasjax_embedding_tokens", "Tokens of the inputs embedded or classified", stats.embedding_tokens),
            ("atlasjax_spec_decode_num_drafts", "Speculative decoding: request-steps that proposed drafts",
             stats.spec.num_drafts),
            ("atlasjax_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed",
             stats.spec.num_draft_tokens),
            ("atlasjax_spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted",
             stats.spec.num_accepted_tokens),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        per_pos = CounterMetricFamily("atlasjax_spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: drafts accepted at each draft position",
                                      labels=["position"])
        for position, value in enumerate(stats.spec.accepted_per_pos):
            per_pos.add_metric([str(position)], value)
        yield per_pos
        yield from _replica_gauges(getattr(self.llm, "replica_stats", None))
        if stats.max_lora:   # vLLM's lora_requests_info: the adapters in use as labels, the time as the value
            info = GaugeMetricFamily("atlasjax_lora_requests_info", "LoRA adapters of running and waiting requests",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(stats.max_lora), ",".join(stats.running_lora_adapters),
                             ",".join(stats.waiting_lora_adapters)], time.time())
            yield info


def _replica_gauges(replicas):
    """With data parallelism (atlasjax/data_parallel.py), each replica's load, labelled engine="RANK" as vLLM's
    (the series above sum the replicas)."""
    if not replicas:
        return
    gauges = (("atlasjax_engine_num_requests_running", "Sequences holding a batch slot, per data-parallel replica",
               lambda s: s.num_running),
              ("atlasjax_engine_num_requests_waiting", "Sequences waiting for a slot, per data-parallel replica",
               lambda s: s.num_waiting),
              ("atlasjax_engine_kv_cache_usage_perc", "Fraction of the KV page pool in use, per data-parallel replica",
               lambda s: s.kv_cache_usage))
    for name, doc, read in gauges:
        family = GaugeMetricFamily(name, doc, labels=["engine"])
        for rank, stats in enumerate(replicas):
            family.add_metric([str(rank)], read(stats))
        yield family
    tokens = CounterMetricFamily("atlasjax_engine_generation_tokens", "Tokens generated, per data-parallel replica",
                                 labels=["engine"])
    for rank, stats in enumerate(replicas):
        tokens.add_metric([str(rank)], stats.generation_tokens)
    yield tokens


class ServerMetrics:
    def __init__(self, llm):
        self.server_load = 0     # HTTP requests in progress, probes aside (serving/middleware.py; vLLM's /load)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("atlasjax_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("atlasjax_prompt_tokens", "Prompt tokens of processed requests", registry=r)
        self.generation_tokens = Counter("atlasjax_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("atlasjax_time_to_first_token_seconds", "Submission to the engine to first token, per sequence",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("atlasjax_inter_token_latency_seconds", "Time between tokens of one sequence",
                             buckets=ITL_BUCKETS, registry=r)
        self.queue_time = Histogram("atlasjax_request_queue_time_seconds",
                                    "Arrival at the engine to first admission, per sequence",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.e2e = Histogram("atlasjax_e2e_request_latency_seconds",
                             "Submission to the engine to the last token, per finished sequence",
                             buckets=E2E_BUCKETS, registry=r)
        self.finished = Counter("atlasjax_requests_finished", "Sequences ended, by finish reason (abort: the "
                                "client went away)", ["finished_reason"], registry=r)
        per_sequence = "per finished sequence"
        self.seq_prompt_tokens = Histogram("atlasjax_request_prompt_tokens", f"Prompt tokens, {per_sequence}",
                                           buckets=TOKEN_BUCKETS, registry=r)
        self.seq_generation_tokens = Histogram("atlasjax_request_generation_tokens",
                                               f"Generated tokens, {per_sequence}", buckets=TOKEN_BUCKETS, registry=r)
        self.seq_tpot = Histogram("atlasjax_request_time_per_output_token_seconds",
                                  f"First to last token over the tokens after the first, {per_sequence} of 2+ tokens",
                                  buckets=TPOT_BUCKETS, registry=r)
        self.seq_prefill = Histogram("atlasjax_request_prefill_time_seconds",
                                     f"First admission to first token, {per_sequence}", buckets=E2E_BUCKETS, registry=r)
        self.seq_decode = Histogram("atlasjax_request_decode_time_seconds",
                                    f"First token to last token, {per_sequence}", buckets=E2E_BUCKETS, registry=r)
        self.seq_inference = Histogram("atlasjax_request_inference_time_seconds",
                                       f"First admission to last token, {per_sequence}", buckets=E2E_BUCKETS,
                                       registry=r)
        self.embedding_latency = Histogram("atlasjax_embedding_request_latency_seconds",
                                           "Submission to the engine to the answer, per embedding request",
                                           buckets=E2E_BUCKETS, registry=r)
        r.register(EngineCollector(llm))

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_token(self, since_previous: float | None, since_start: float, num_tokens: int) -> None:
        """One delta of one sequence: its first token (TTFT) or a later one (inter-token latency)."""
        if since_previous is None:
            self.ttft.observe(since_start)
        else:
            self.itl.observe(since_previous)
        self.generation_tokens.inc(num_tokens)

    def observe_queue(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def observe_finish(self, reason: str, since_start: float | None) -> None:
        """A sequence ended: "stop" / "length" with its end-to-end latency, or "abort" (None)."""
        self.finished.labels(finished_reason=reason).inc()
        if since_start is not None:
            self.e2e.observe(since_start)

    def observe_sequence(self, prompt_tokens: int, generated_tokens: int, first_token: float, last_token: float,
                         queue: float | None) -> None:
        """A sequence that finished with tokens: its lengths, and its phases in seconds since submission
        (queue: arrival to first admission, as the engine measured it; None if it never said)."""
        self.seq_prompt_tokens.observe(prompt_tokens)
        self.seq_generation_tokens.observe(generated_tokens)
        admitted = min(queue or 0.0, first_token)
        self.seq_prefill.observe(first_token - admitted)
        self.seq_decode.observe(last_token - first_token)
        self.seq_inference.observe(last_token - admitted)
        if generated_tokens > 1:
            self.seq_tpot.observe((last_token - first_token) / (generated_tokens - 1))

    def observe_embedding(self, seconds: float) -> None:
        self.embedding_latency.observe(seconds)

    def add_prompt_tokens(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

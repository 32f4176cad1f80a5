"""Engine counters and gauges (plain Python): what /metrics exports and benchmarks read."""
from __future__ import annotations

import collections
import dataclasses

from atlasjax.speculative import SpecStats


@dataclasses.dataclass
class EngineStats:
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0          # prompt tokens computed (cache hits excluded)
    cached_prompt_tokens: int = 0   # prompt tokens served by the prefix cache
    generation_tokens: int = 0
    num_embedding_inputs: int = 0   # inputs embedded (`LLMEngine.embed`)
    embedding_tokens: int = 0       # their tokens
    num_steps: int = 0
    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    pages_used: int = 0
    pages_free: int = 0
    pages_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0      # device and host-tier hits
    kv_offload_hits: int = 0        # prompt pages copied back from host memory (kv_offloading_size)
    kv_offload_saved: int = 0       # evicted pages copied to host memory
    kv_offload_pages: int = 0       # pages held in host memory now
    kv_offload_capacity: int = 0    # and the most it holds (0: offloading off)
    kv_offload_disk_pages: int = 0      # pages held in files (kv_offloading_disk)
    kv_offload_disk_capacity: int = 0   # and the most they may be
    kv_offload_disk_reads: int = 0      # pages read back from files
    kv_offload_disk_reading: int = 0    # pages being read from files now (their requests wait in the queue)
    last_step_seconds: float = 0.0
    read_wait_seconds: float = 0.0  # time the engine thread spent blocked reading step outputs back
    spec: SpecStats = dataclasses.field(default_factory=SpecStats)   # speculative decoding's drafts
    max_lora: int = 0                             # LoRA device slots (0: LoRA off)
    running_lora_adapters: tuple[str, ...] = ()   # the adapters of running requests (names, sorted)
    waiting_lora_adapters: tuple[str, ...] = ()   # and of waiting ones
    step_seconds: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=1000))

    def record_step(self, seconds: float, sched, engine) -> None:
        self.num_steps += 1
        self.last_step_seconds = seconds
        self.step_seconds.append(seconds)
        self.refresh(engine)

    def refresh(self, engine) -> None:
        s, pool = engine.scheduler, engine.pool
        self.num_running, self.num_waiting = len(s.running), len(s.waiting)
        self.pages_used, self.pages_free, self.pages_total = pool.num_used_pages, pool.num_free_pages, pool.num_pages
        self.num_preemptions = s.num_preemptions
        self.prefix_cache_queries, self.prefix_cache_hits = pool.num_queried_pages, pool.num_hit_pages
        if (tier := getattr(engine, "kv_offload", None)) is not None:
            self.kv_offload_hits, self.kv_offload_saved = pool.num_second_tier_hit_pages, tier.num_saved_pages
            self.kv_offload_pages, self.kv_offload_capacity = tier.num_pages, tier.capacity_pages
            if (disk := tier.disk) is not None:
                self.kv_offload_disk_pages, self.kv_offload_disk_capacity = disk.num_pages, disk.capacity_pages
                self.kv_offload_disk_reads, self.kv_offload_disk_reading = disk.num_read, tier.num_reading
        if getattr(engine, "lora", None) is not None:
            self.max_lora = engine.lora.max_loras
            self.running_lora_adapters, self.waiting_lora_adapters = (
                tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))
                for requests in (s.running, s.waiting))

    def record_finish(self, req) -> None:
        self.num_finished += 1
        self.cached_prompt_tokens += req.num_cached_tokens or 0

    @property
    def kv_cache_usage(self) -> float:
        """Pages in use (free ones, cached prefixes included, not counted) over the pool, 0 to 1."""
        return (self.pages_total - self.pages_free) / self.pages_total if self.pages_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

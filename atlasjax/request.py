"""Request state as the scheduler and engine see it (plain Python, no jax)."""
from __future__ import annotations

import dataclasses
import enum

from atlasjax.page_pool import cache_root
from atlasjax.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    priority: int = 0                     # with the priority scheduling policy: lower is admitted sooner,
                                          # preempted later (atlasjax/waiting_queue.py)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache or written by a dispatched step
    num_pending_tokens: int = 0           # sampled by a dispatched step, value not read back yet (0, 1, or up to
                                          # num_scheduler_steps after a multi-step decode)
    num_steps_in_flight: int = 0          # dispatched steps not yet read back that write this request's pages
    release_pending: bool = False         # finished while in flight: pages and slot return when those steps end
    pages: list[int] = dataclasses.field(default_factory=list)
    page_keys: list[tuple] = dataclasses.field(default_factory=list)
    num_registered_pages: int = 0
    slot: int = -1                        # row in the device-side per-slot state
    bad_word_ids: list[list[int]] = dataclasses.field(default_factory=list)   # params.bad_words tokenized
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache (first admission)
    queue_seconds: float | None = None    # arrival to first admission (time.monotonic, set by the engine)
    num_preemptions: int = 0
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # outputs kept for the caller
    logprobs: list[dict] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None
    text: str = ""
    emitted_chars: int = 0                # text already streamed (the rest may still become a stop string)
    token_history: object = None          # speculative decoding: its tokens as a numpy array (speculative.py)
    accepted_per_round: float | None = None   # n-gram speculation: recent drafts kept a verify round (ngram_gate.py)
    lora_request: object = None           # its LoRARequest (atlasjax/lora.py), or None: the base model
    lora_adapter: object = None           # that adapter as read and checked when the request was added
    lora_slot: int = -1                   # the device LoRA slot it runs with while admitted (-1: none)
    cache_salt: str | None = None         # vLLM's: prefix-cache pages shared only with the same salt
    index: int = 0                        # which of the parent request's n completions
    parent_id: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def cache_root(self) -> int:
        """The parent of its first prompt page's prefix-cache key: pages computed under different adapters, or for
        requests of different cache salts, never match."""
        return cache_root(self.lora_request, self.cache_salt)

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus the pending one (its value is still on the device)."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, pending included (the seed stream's position)."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def records_prompt_logprobs(self) -> bool:
        """Its prefill must compute logprobs at every prompt position (asked for, and not all recorded yet:
        a request preempted before that computes its prompt again): it takes no prefix-cache hits past the
        positions recorded (`Scheduler._cacheable`)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs or ()) < len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """Still computing K/V for known tokens (prompt, or prompt + outputs after preemption)."""
        return self.num_computed_tokens < self.num_total_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

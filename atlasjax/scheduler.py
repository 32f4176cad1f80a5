"""Continuous-batching scheduler: decodes first, then chunked prefills within a token budget.

Plain Python, no jax. Each `schedule()` call returns which running requests decode one token
and which requests prefill which chunk; pages are allocated here (prefix-cache hits first).
When pages run out during decode, the newest running request is preempted: its pages are freed
and it goes back to the front of the queue, to be recomputed from its tokens later.
"""
from __future__ import annotations

import collections
import dataclasses

from atlasjax.page_pool import PagePool
from atlasjax.request import Request, Status


@dataclasses.dataclass
class PrefillChunk:
    request: Request
    start: int        # first token index computed in this chunk
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the last known token, so its logits yield a new token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    decodes: list[Request]
    prefills: list[PrefillChunk]
    admitted: list[Request]           # got a slot this step (device-side slot state must be reset)
    preempted: list[Request]

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, pool: PagePool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_seqs: int | None = None):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_seqs = max_prefill_seqs or max_num_seqs
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    # ---- queue
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        decodes, prefills, admitted, preempted = [], [], [], []
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue                              # preempted earlier in this loop
            if req.is_prefilling:
                num = min(req.num_tokens - req.num_computed_tokens, budget)
                if num <= 0 or len(prefills) >= self.max_prefill_seqs:
                    continue
                if self._reserve(req, req.num_computed_tokens + num, preempted):
                    prefills.append(PrefillChunk(req, req.num_computed_tokens, num))
                    budget -= num
            elif self._reserve(req, req.num_tokens, preempted):
                decodes.append(req)
                budget -= 1
        decodes = [r for r in decodes if r.status is Status.RUNNING]
        prefills = [c for c in prefills if c.request.status is Status.RUNNING]
        if not preempted:  # admit new work only when nothing had to give way this step
            self._admit(budget, prefills, admitted)
        for chunk in prefills:
            self._register_pages(chunk.request, chunk.start + chunk.num_tokens)
        for req in decodes:
            self._register_pages(req, req.num_tokens)
        return SchedulerOutput(decodes, prefills, admitted, preempted)

    def _admit(self, budget: int, prefills: list[PrefillChunk], admitted: list[Request]) -> None:
        ps = self.pool.page_size
        while self.waiting and self.free_slots and budget > 0 and len(prefills) < self.max_prefill_seqs:
            req = self.waiting[0]
            if not req.pages:
                keys = self.pool.extend_keys(req.page_keys, req.all_token_ids)
                # Leave at least one token to compute (its logits give the next token), starting on a page boundary.
                hits = self.pool.lookup(keys[:(req.num_tokens - 1) // ps])
                req.pages = hits
                req.num_registered_pages = len(hits)
                req.num_computed_tokens = len(hits) * ps
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = req.num_computed_tokens
            num = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_for(req, req.num_computed_tokens + num):
                self.pool.free(req.pages)            # give back the cache hits; retry next step
                req.pages, req.num_computed_tokens, req.num_registered_pages = [], 0, 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.slot = self.free_slots.pop()
            self.running.append(req)
            admitted.append(req)
            prefills.append(PrefillChunk(req, req.num_computed_tokens, num))
            budget -= num

    def _reserve(self, req: Request, num_tokens: int, preempted: list[Request]) -> bool:
        """Pages for `num_tokens` of req, preempting the newest running requests if needed."""
        while not self._allocate_for(req, num_tokens):
            victim = next(r for r in reversed(self.running) if r.status is Status.RUNNING)
            self.preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _allocate_for(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.pool.page_size) - len(req.pages)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        req.pages.extend(self.pool.allocate(need))
        return True

    def _register_pages(self, req: Request, num_computed_after: int) -> None:
        full = num_computed_after // self.pool.page_size
        if full > req.num_registered_pages:
            self.pool.extend_keys(req.page_keys, req.all_token_ids[:full * self.pool.page_size])
            self.pool.register(req.pages, req.page_keys, req.num_registered_pages, full)
            req.num_registered_pages = full

    # ---- state changes after a step
    def preempt(self, req: Request) -> None:
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            if req.pages:
                self.pool.free(req.pages)
                req.pages = []
        elif req.status is Status.RUNNING:
            self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = req.finish_reason or reason

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.pages)
        req.pages, req.num_computed_tokens, req.num_registered_pages = [], 0, 0
        self.free_slots.append(req.slot)
        req.slot = -1

"""Continuous-batching scheduler: decodes first, then chunked prefills within a token budget.

Plain Python, no jax. Each `schedule()` call returns which running requests decode one token
and which requests prefill which chunk; pages are allocated here (prefix-cache hits first).
When pages run out during decode, a running request is preempted: its pages are freed and it goes
back to the queue, to be recomputed from its tokens later. The policy (atlasjax/waiting_queue.py)
picks which: `fcfs` (default) admits in arrival order and preempts the newest running request, which
goes back to the front; `priority` admits by (priority, arrival), lower first, and preempts the
running request that comes last in that order.

Multi-step decoding (`num_scheduler_steps` K > 1): a step with only decodes (no prefill chunk, nobody
admitted, and no waiting request that a free slot could take) gives each request up to K decode
iterations in one launch (`SchedulerOutput.steps`), bounded by its max_tokens and by the pages it can
get without preempting anyone. Tokens after a stop are discarded by the engine.

Asynchronous scheduling: step N+1 is scheduled before step N's tokens are read back, so a request
may have *pending* tokens (sampled on the device, value unknown; up to K with multi-step). Scheduling counts it
(`Request.num_total_tokens`): the next decode feeds it from the device and needs a page for it;
`num_computed_tokens` advances when a step is scheduled. The engine brackets each step with
`dispatched(out)` and `completed(out)`; a request that finishes while a dispatched step still
writes its pages keeps them until that step completes. Its slot is free at once: the next
request's admit step (which resets the slot's penalty row) runs after that step on the device.

Speculative decoding (`speculative`, atlasjax/speculative.py): a decode-only step gives each request drafts, verified
in one step or in several verify rounds per launch; atlasjax/draft_scheduling.py says how.

LoRA (`lora`, atlasjax/lora.py): a waiting request is admitted only when its adapter has a device slot (resident,
or written into one that no running request uses); while it waits, requests behind it that can run are admitted.
Its engine slot's release frees its hold on the adapter's slot.

Prompt logprobs: a step with a chunk that records them (`Request.records_prompt_logprobs`) takes at most
`prompt_logprobs_tokens` prefill tokens in all (`EngineConfig.prompt_logprobs_tokens`: the one token count
such a step runs); other chunks of the step share that cap, or wait for a later step.
"""
from __future__ import annotations

from atlasjax import ngram_gate
from atlasjax.draft_scheduling import DraftScheduling
from atlasjax.page_pool import PagePool
from atlasjax.request import Request, Status
from atlasjax.scheduler_output import PrefillChunk, SchedulerOutput
from atlasjax.waiting_queue import WaitingQueue, priority_key


class Scheduler(DraftScheduling):
    def __init__(self, pool: PagePool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_seqs: int | None = None, num_scheduler_steps: int = 1,
                 prompt_logprobs_tokens: int | None = None, policy: str = "fcfs", speculative=None, lora=None):
        self.pool = pool
        self.lora = lora                 # a LoRAManager (atlasjax/lora.py), or None
        self.speculative = speculative   # a SpeculativeConfig, or None
        self.num_scheduler_steps = num_scheduler_steps
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # prefill tokens of a step with a prompt-logprob chunk (None: no cap beyond the budget)
        self.prompt_logprobs_tokens = prompt_logprobs_tokens or max_num_batched_tokens
        self.max_prefill_seqs = max_prefill_seqs or max_num_seqs
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.held: set[Request] = set()   # arrived during a pause (atlasjax/pause.py): not admitted until resume
        # the verify-rounds launch read back last accepted a draft: n-gram launches are scheduled behind one another
        # only then (text that stopped repeating goes back to the host's lookup, which may find no draft)
        self.drafts_accepted = True
        self.ngram_gate = ngram_gate.Gate()   # n-gram drafts only while their acceptance pays for them

    # ---- queue
    def add(self, req: Request) -> None:
        self.waiting.add(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling
    def schedule(self, behind_verify: bool = False) -> SchedulerOutput:
        """The next step. behind_verify: it is scheduled behind a verify-rounds launch still in flight (the engine
        asked `can_pipeline_verify`), so it is another (n-gram drafts too, without a lookup here)."""
        budget = self.max_num_batched_tokens
        decodes, prefills, admitted, preempted = [], [], [], []
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue                              # preempted earlier in this loop
            if req.is_prefilling:
                num = min(req.num_total_tokens - req.num_computed_tokens, self._room(req, budget, prefills))
                if num <= 0 or len(prefills) >= self.max_prefill_seqs:
                    continue
                if self._reserve(req, req.num_computed_tokens + num, preempted):
                    prefills.append(PrefillChunk(req, req.num_computed_tokens, num))
                    budget -= num
            elif req.num_generated >= req.max_tokens:
                self._retire(req)                     # its pending token is its last: the engine finishes it
            elif self._reserve(req, req.num_total_tokens, preempted):
                decodes.append(req)
                budget -= 1
        decodes = [r for r in decodes if r.status is Status.RUNNING]
        prefills = [c for c in prefills if c.request.status is Status.RUNNING]
        if not preempted:  # admit new work only when nothing had to give way this step
            self._admit(budget, prefills, admitted)
        admitting = bool(self.waiting and self.free_slots)   # a request could be admitted next step: one iteration
        drafts = {} if self.speculative is None or prefills else self._drafts(decodes, admitting, behind_verify)
        steps = self._multi_steps(decodes) if not prefills and not drafts and not admitting else {}
        rounds = self._verify_rounds(decodes, drafts) if drafts and not admitting else 1
        for chunk in prefills:
            self._computed(chunk.request, chunk.start + chunk.num_tokens)
        for req in decodes:
            self._computed(req, req.num_total_tokens + steps.get(req, 1) - 1 + len(drafts.get(req, ())))
        return SchedulerOutput(decodes, prefills, admitted, preempted, steps, drafts, rounds)

    def _multi_steps(self, decodes: list[Request]) -> dict[Request, int]:
        """Decode iterations per request for a decode-only launch: up to num_scheduler_steps, within
        max_tokens, with the pages that can be had without preempting (else as many as its pages hold)."""
        steps = {}
        if self.num_scheduler_steps == 1:
            return steps
        ps = self.pool.page_size
        for req in decodes:
            n = min(self.num_scheduler_steps, req.max_tokens - req.num_generated)
            # iteration j writes K/V at position num_total_tokens - 1 + j
            if n > 1 and not self._allocate_for(req, req.num_total_tokens + n - 1):
                n = min(n, len(req.pages) * ps - req.num_total_tokens + 1)
            if n > 1:
                steps[req] = n
        return steps

    def _computed(self, req: Request, num_computed: int) -> None:
        """The step being scheduled writes K/V up to num_computed; register the full pages of known tokens."""
        req.num_computed_tokens = num_computed
        self._register_pages(req, min(num_computed, req.num_tokens))

    def _admit(self, budget: int, prefills: list[PrefillChunk], admitted: list[Request]) -> None:
        ps = self.pool.page_size
        while self.waiting and self.free_slots and budget > 0 and len(prefills) < self.max_prefill_seqs:
            req = self._next_admissible()
            if req is None:
                break                 # every LoRA slot holds another adapter in use, or every prefix is on its way
            if req.num_pending_tokens:
                break                                # preempted with a token still on the device: next step
            room = self._room(req, budget, prefills)
            if room <= 0:
                break                                # the step's prompt-logprob cap is full: next step
            if not req.pages:
                hits = self.pool.lookup(self._cache_keys(req))
                req.pages = hits
                req.num_registered_pages = len(hits)
                req.num_computed_tokens = len(hits) * ps
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = req.num_computed_tokens
            num = min(req.num_tokens - req.num_computed_tokens, room)
            if not self._allocate_for(req, req.num_computed_tokens + num):
                self.pool.free(req.pages)            # give back the cache hits; retry next step
                req.pages, req.num_computed_tokens, req.num_registered_pages = [], 0, 0
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            req.slot = self.free_slots.pop()
            if self.lora is not None:
                self.lora.acquire(req)
            self.running.append(req)
            admitted.append(req)
            prefills.append(PrefillChunk(req, req.num_computed_tokens, num))
            budget -= num

    def _next_admissible(self) -> Request | None:
        """The waiting request admitted next: the first in the queue's order whose LoRA adapter can have a device
        slot now and whose cached prefix is not being read from disk (requests behind those wait less), and that
        did not arrive during a pause."""
        for req in self.waiting:
            if req in self.held:
                continue
            if self.lora is not None and not self.lora.can_place(req):
                continue
            if not req.pages and self.pool.fetching(self._cache_keys(req)):
                continue
            return req
        return None

    def _cache_keys(self, req: Request) -> list[tuple]:
        """The keys of req's pages a lookup may take from the prefix cache: at least one token is left to compute
        (its logits give the next token), starting on a page boundary."""
        keys = self.pool.extend_keys(req.page_keys, req.all_token_ids, req.cache_root)
        return keys[:(self._cacheable(req) - 1) // self.pool.page_size]

    @staticmethod
    def _cacheable(req: Request) -> int:
        """Leading tokens whose K/V req may take from the prefix cache: prompt logprobs need every position
        not recorded yet computed (on first admission all of them, as in vLLM; after a preemption mid-prompt,
        those past what was recorded). Its pages are still registered for others."""
        if req.records_prompt_logprobs:
            return min(req.num_tokens, len(req.prompt_logprobs or [None]))
        return req.num_tokens

    def _room(self, req: Request, budget: int, prefills: list[PrefillChunk]) -> int:
        """Tokens req's chunk may take: the step's budget left, and with a chunk that records prompt logprobs
        in the step (req's own or one scheduled already) what is left of prompt_logprobs_tokens."""
        if req.records_prompt_logprobs or any(c.request.records_prompt_logprobs for c in prefills):
            return min(budget, self.prompt_logprobs_tokens - sum(c.num_tokens for c in prefills))
        return budget

    def _reserve(self, req: Request, num_tokens: int, preempted: list[Request]) -> bool:
        """Pages for `num_tokens` of req, preempting running requests (`_victim`) if needed."""
        while not self._allocate_for(req, num_tokens):
            victim = self._victim()
            self.preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _victim(self) -> Request:
        """The running request to preempt: fcfs, the newest; priority, the last in (priority, arrival)
        order (the newest of equals)."""
        candidates = [r for r in reversed(self.running) if r.status is Status.RUNNING]
        if self.waiting.policy == "priority":
            return max(candidates, key=priority_key)
        return candidates[0]

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
            self.pool.extend_keys(req.page_keys, req.all_token_ids[:full * self.pool.page_size], req.cache_root)
            self.pool.register(req.pages, req.page_keys, req.num_registered_pages, full)
            req.num_registered_pages = full

    # ---- steps in flight
    def dispatched(self, out: SchedulerOutput) -> None:
        """The engine launched this step: its requests' pages are written until `completed(out)`."""
        for req in out.requests:
            req.num_steps_in_flight += 1

    def completed(self, out: SchedulerOutput) -> None:
        """The step has run on the device: finished requests it was still writing give their pages back."""
        for req in out.requests:
            req.num_steps_in_flight -= 1
            if req.release_pending and req.num_steps_in_flight == 0:
                req.release_pending = False
                self._free_pages(req)

    # ---- state changes after a step
    def preempt(self, req: Request) -> None:
        # Freed at once (preemption exists to get pages now) even if a dispatched step still writes them:
        # steps are chained through the donated cache, so that write lands before any later step's write
        # or read, and what it writes into a registered page is that page's true content.
        self.running.remove(req)
        self._free_pages(req)
        self._free_slot(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(req)

    def finish(self, req: Request, reason: str) -> None:
        self.held.discard(req)
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            if req.pages:
                self.pool.free(req.pages)
                req.pages = []
        elif req.status is Status.RUNNING and req in self.running:    # (not when retired already)
            self._retire(req)
        req.status = Status.FINISHED
        req.finish_reason = req.finish_reason or reason

    def _retire(self, req: Request) -> None:
        """Nothing more to schedule: out of the running set with its slot free at once; its pages are
        freed when no dispatched step writes them any more (see completed())."""
        self.running.remove(req)
        self._free_slot(req)
        if req.num_steps_in_flight:
            req.release_pending = True
        else:
            self._free_pages(req)

    def _free_pages(self, req: Request) -> None:
        self.pool.free(req.pages)
        req.pages, req.num_computed_tokens, req.num_registered_pages = [], 0, 0

    def _free_slot(self, req: Request) -> None:
        if self.lora is not None:
            self.lora.release(req)
        self.free_slots.append(req.slot)
        req.slot = -1

"""Scheduling speculative drafts: `DraftScheduling`, the base of `Scheduler` (atlasjax/scheduler.py), decides which
requests of a decode-only step get drafts, how many verify rounds a launch runs, and whether the next launch may be
scheduled behind a verify launch still in flight. Plain Python, no jax.

Speculative decoding (`speculative`, atlasjax/speculative.py): a decode-only step gives each request up to k
drafts (`SchedulerOutput.drafts`), within its max_tokens, the step's token budget and the pages it can get
without preempting anyone; a step where no request has a draft is a plain (multi-step) decode. n-gram drafts are
looked up here, tokens still pending on the device included and passed over (the drafts follow them); a draft
model's are placeholders (`DRAFT_ON_DEVICE`) that the verify step proposes on the device, and such a step runs
num_scheduler_steps verify rounds in one launch (`SchedulerOutput.rounds`, atlasjax/verify_rounds.py) under multi-step's
conditions. So do n-gram drafts where such a launch can run (num_scheduler_steps > 1): once a lookup here finds a
draft for one request (or behind a verify-rounds launch in flight), every request gets placeholders, and each round
looks its drafts up on the device (atlasjax/ngram_lookup.py). The engine reads a verify step back before it
schedules the next one (its accepted drafts move every later position), unless the next is another verify-rounds
launch of the same requests (`can_pipeline_verify`). Its K/V is written for its last token and every draft; once the
step is read back, `speculated` sets its computed tokens to those the accepted drafts reach. Pages are registered
in the prefix cache only for known tokens, never drafts.
"""
from __future__ import annotations

from atlasjax import speculative
from atlasjax.request import Request, Status


def verify_reach(req: Request, num_drafts: int, rounds: int, generated: int | None = None) -> int:
    """Tokens a verify launch may emit for req, and K/V positions it may write from its last token's on: `rounds`
    rounds of its last token and drafts, within what its max_tokens leaves after `generated` outputs (default
    num_generated; a pipelined launch's bound counts only the known ones, since the launch before it may emit
    fewer than its own bound)."""
    return min(rounds * (1 + num_drafts), req.max_tokens - (req.num_generated if generated is None else generated))


class DraftScheduling:
    """Speculative decoding's share of the `Scheduler`, which sets `speculative`, `pool`, `num_scheduler_steps`,
    `max_num_batched_tokens`, `waiting`, `running`, `free_slots`, `drafts_accepted` and `ngram_gate`, and gives
    `_allocate_for`."""

    def _drafts(self, decodes: list[Request], admitting: bool, behind_verify: bool) -> dict[Request, list[int]]:
        """Drafts per request of a decode-only step (atlasjax/speculative.py): n-gram lookups, or a draft model's
        placeholders (its drafts are proposed inside the verify step; so are n-gram drafts where the launch runs
        several rounds: not `admitting`, and a lookup here found one or `behind_verify`); none for a request whose
        sampling keeps per-token state on the device (penalties, bad words), which a verify step does not
        advance, none at all in a step of `disable_by_batch_size` requests or more, and no n-gram drafts while the
        requests' recent acceptance does not pay for them (ngram_gate.py)."""
        spec = self.speculative
        if spec.disable_by_batch_size is not None and len(decodes) >= spec.disable_by_batch_size:
            return {}
        if any(not speculative.can_speculate(req.params) for req in decodes):
            return {}      # their penalty counts and bad-word history advance only in a decode step
        if not spec.uses_draft_model and not behind_verify and not self.ngram_gate.allow(decodes):
            return {}      # recent n-gram drafts were rarely accepted: a plain launch (ngram_gate.py)
        drafts, budget, ps = {}, self.max_num_batched_tokens - len(decodes), self.pool.page_size
        on_device = spec.uses_draft_model
        if spec.drafts_on_device(self.num_scheduler_steps) and not admitting and not on_device:   # n-gram lookups
            # on the device, round by round, once one here finds a draft (a request that has none yet may find one
            # in a later round); with none, no drafts at all
            on_device = behind_verify or any(self._lookup(req, 1) for req in decodes if req.num_generated + 2
                                             <= req.max_tokens)
            if not on_device:
                return {}
        for req in decodes:
            room = min(spec.num_speculative_tokens, req.max_tokens - req.num_generated - 1, budget)
            if room <= 0:
                continue
            # rows for the drafts the verify step proposes, or the host's n-gram lookup
            proposed = [speculative.DRAFT_ON_DEVICE] * room if on_device else self._lookup(req, room)
            # draft j writes K/V at position num_total_tokens + j
            if proposed and not self._allocate_for(req, req.num_total_tokens + len(proposed)):
                proposed = proposed[:len(req.pages) * ps - req.num_total_tokens]
            if proposed:
                drafts[req] = proposed
                budget -= len(proposed)
        return drafts

    def _lookup(self, req: Request, room: int) -> list[int]:
        """req's n-gram drafts (up to `room`): tokens still on the device (async scheduling) are predicted by the
        same lookup, then passed over."""
        spec, pending = self.speculative, req.num_pending_tokens
        return speculative.propose(speculative.request_tokens(req), room + pending, spec.prompt_lookup_min,
                                   spec.prompt_lookup_max)[pending:]

    def _verify_rounds(self, decodes: list[Request], drafts: dict[Request, list[int]]) -> int:
        """Verify rounds of a launch whose drafts are proposed on the device: num_scheduler_steps (with one, n-gram
        drafts are looked up here). Each request gets the pages for what its rounds may write, within
        its max_tokens, as far as they can be had without preempting anyone (the step writes nothing past its
        pages and accepts no draft there)."""
        rounds = self.num_scheduler_steps
        if rounds == 1 or not self.speculative.drafts_on_device(rounds):
            return 1
        for req in decodes:   # its K/V positions start at its last token's, num_total_tokens - 1
            self._allocate_for(req, req.num_total_tokens - 1 + verify_reach(req, len(drafts.get(req, ())), rounds))
        return rounds

    def speculated(self, req: Request) -> None:
        """After a verify step is read back: req's K/V is valid up to its last accepted draft (its newest token,
        sampled by the step, is computed by the next one; a pipelined launch still in flight computes its pending
        tokens). A finished request's pages are gone already."""
        if req.status is Status.RUNNING:
            req.num_computed_tokens = req.num_total_tokens - 1

    def verify_dispatched(self, req: Request, reach: int) -> None:
        """A verify launch that may emit `reach` tokens for req was dispatched: they are pending (a bound until it
        is read back), and its K/V counts as computed up to them."""
        req.num_pending_tokens += reach
        req.num_computed_tokens = req.num_total_tokens - 1

    def can_pipeline_verify(self, in_flight: list[Request]) -> bool:
        """Whether the next step may be scheduled before the verify launch in flight (over `in_flight`, drafts
        proposed on the device, several rounds) is read back: it will be another such launch over the same requests,
        each with a draft, and none of them retires, preempts or is preempted. Its requests' pending tokens are
        then only a bound (what that launch may emit), and the next launch is packed from the tokens known now
        (verify_rounds.py moves each request along on the device)."""
        spec = self.speculative
        if (spec is None or self.num_scheduler_steps == 1 or not in_flight
                or (self.waiting and self.free_slots) or len(self.running) != len(in_flight)
                or set(self.running) != set(in_flight)):
            return False
        if spec.disable_by_batch_size is not None and len(in_flight) >= spec.disable_by_batch_size:
            return False
        if not spec.uses_draft_model and not (self.drafts_accepted and self.ngram_gate.pays(in_flight)):
            return False
        need = 0
        for req in in_flight:
            # room for one draft at least past everything the launch in flight may emit, and its pages now
            if (req.status is not Status.RUNNING or req.is_prefilling or not speculative.can_speculate(req.params)
                    or req.num_generated + 2 > req.max_tokens):
                return False
            need += max(0, -(-(req.num_total_tokens + 1) // self.pool.page_size) - len(req.pages))
        return self.max_num_batched_tokens >= 2 * len(in_flight) and self.pool.can_allocate(need)

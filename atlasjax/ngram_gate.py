"""When n-gram speculation pays: the scheduler drafts while its requests' recent acceptance covers what a verify round
costs over a plain decode iteration, and otherwise runs plain (multi-step) decode launches, trying drafts again now
and then.

A lookup finding an n-gram says nothing about whether the model will follow it: text that repeats short n-grams
(`prompt_lookup_min` 1 or 2) without repeating what came after them has drafts found in most rounds and accepted in
few. A verify round then emits about one token, as a decode iteration does, at a higher cost: on an H200 (Llama-3.1-8B
shapes, bf16, 4 drafts) a pipelined round costs 1.15x a decode iteration at bs=1 and 1.33x at bs=8 (1.4-1.55x read
back first), so the drafts pay from about 0.15-0.55 accepted per round. Each request keeps a moving average of the
drafts accepted in its verify rounds (`record_round`); a launch drafts while the batch's mean is at least
MIN_ACCEPTED_PER_ROUND (a new request starts at one a round, so it drafts a few rounds before the gate can close for
it). After PROBE_AFTER plain launches in a row the next drafts anyway, so acceptance that comes back is found.
Outputs never change: only which launches verify.
`ATLASJAX_NGRAM_GATE=off` drafts wherever a lookup finds one (to measure against).

Plain Python, no jax. Draft models and EAGLE-3 heads are not gated (their rounds cost more, by how much depends on the
draft; their acceptance on real checkpoints is unmeasured here).
"""
from __future__ import annotations

import os

MIN_ACCEPTED_PER_ROUND = 0.3
PAST_WEIGHT = 0.75          # each new round moves a request's average a quarter of the way
FIRST_GUESS = 1.0           # a new request's average: five rounds without a kept draft bring it under the minimum
PROBE_AFTER = 8             # plain launches in a row before drafts are tried again


def enabled() -> bool:
    return os.environ.get("ATLASJAX_NGRAM_GATE", "on") != "off"


def recent(req) -> float:
    """req's moving average of drafts kept a verify round (FIRST_GUESS before its first round)."""
    return FIRST_GUESS if req.accepted_per_round is None else req.accepted_per_round


def record_round(req, accepted: int) -> None:
    """One verify round of req read back: `accepted` of its drafts kept (0 where it had none)."""
    req.accepted_per_round = PAST_WEIGHT * recent(req) + (1 - PAST_WEIGHT) * accepted


def acceptance_pays(requests) -> bool:
    """Whether the requests' recent acceptance, averaged over them, pays for verify rounds."""
    return sum(recent(r) for r in requests) >= MIN_ACCEPTED_PER_ROUND * len(requests)


class Gate:
    """The scheduler's: per decode-only launch, whether its requests draft (`allow`), counting the plain launches
    it decided in a row."""

    def __init__(self, on: bool | None = None):
        self.on = enabled() if on is None else on
        self.plain_launches = 0       # launches in a row this gate kept plain
        self.num_gated = 0            # launches it kept plain in all

    def pays(self, requests) -> bool:
        """Whether the requests' acceptance pays for drafts (always, switched off)."""
        return not self.on or acceptance_pays(requests)

    def allow(self, requests) -> bool:
        """Whether a launch of these requests drafts: their acceptance pays, or it is time to try again."""
        if self.pays(requests) or self.plain_launches >= PROBE_AFTER:
            self.plain_launches = 0
            return True
        self.plain_launches += 1
        self.num_gated += 1
        return False

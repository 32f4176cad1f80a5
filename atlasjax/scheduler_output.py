"""What one `Scheduler.schedule()` call decides (atlasjax/scheduler.py): the running requests that decode, the
prefill chunks, who was admitted or preempted, and with multi-step or speculative decoding each request's decode
iterations, drafts and verify rounds. Plain Python, no jax: the engine packs it into a step (step_packing.py),
launches it (step_launch.py) and reads it back (step_readback.py).
"""
from __future__ import annotations

import dataclasses

from atlasjax.request import Request


@dataclasses.dataclass
class PrefillChunk:
    request: Request
    start: int        # first token index computed in this chunk
    num_tokens: int
    completes_prompt: bool = dataclasses.field(init=False)

    def __post_init__(self):
        # Fixed when scheduled: the chunk reaches the last token, so its logits yield a new token.
        self.completes_prompt = self.start + self.num_tokens == self.request.num_total_tokens


@dataclasses.dataclass
class SchedulerOutput:
    decodes: list[Request]
    prefills: list[PrefillChunk]
    admitted: list[Request]           # got a slot this step (device-side slot state must be reset)
    preempted: list[Request]
    steps: dict[Request, int] = dataclasses.field(default_factory=dict)  # decode iterations (absent: 1)
    drafts: dict[Request, list[int]] = dataclasses.field(default_factory=dict)  # speculative drafts (absent: none)
    rounds: int = 1                   # verify rounds of a launch with drafts proposed on the device (verify_rounds.py)

    @property
    def num_steps(self) -> int:
        """Decode iterations of this launch (the largest of its requests')."""
        return max(self.steps.values(), default=1)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def requests(self) -> list[Request]:
        return self.decodes + [c.request for c in self.prefills]

"""The scheduler's waiting requests, in the order free slots admit them (plain Python, no jax).

Two policies, as vLLM's `--scheduling-policy`:
- `fcfs`: arrival order. A preempted request goes back to the front: it was running, so it arrived
  before everything still waiting (or was admitted ahead of it).
- `priority`: by (priority, arrival time), lower values first; a preempted request goes back to its
  place in that order. Equal keys keep the order they were queued in.
"""
from __future__ import annotations

import bisect

from atlasjax.errors import InvalidRequestError
from atlasjax.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def check_priority(priority, policy: str) -> None:
    """A request's priority: any integer under `priority`, only 0 under `fcfs` (as vLLM answers)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise InvalidRequestError(f"priority {priority} needs the priority scheduling policy "
                                  f"(scheduling_policy='priority', --scheduling-policy priority); "
                                  f"this engine schedules {policy}")


def priority_key(req: Request) -> tuple[int, float]:
    """Smaller is served first, and preempted last (`Scheduler._victim`)."""
    return req.priority, req.arrival_time


class WaitingQueue:
    def __init__(self, policy: str = "fcfs"):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.policy = policy
        self._requests: list[Request] = []

    def add(self, req: Request) -> None:
        """A new request."""
        if self.policy == "fcfs":
            self._requests.append(req)
        else:
            bisect.insort_right(self._requests, req, key=priority_key)

    def requeue(self, req: Request) -> None:
        """A preempted request, to be admitted again."""
        if self.policy == "fcfs":
            self._requests.insert(0, req)
        else:
            bisect.insort_left(self._requests, req, key=priority_key)

    def pop(self) -> Request:
        """The request admitted next (the one `self[0]` shows)."""
        return self._requests.pop(0)

    def remove(self, req: Request) -> None:
        self._requests.remove(req)

    def __getitem__(self, i: int) -> Request:
        return self._requests[i]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self):
        return iter(self._requests)

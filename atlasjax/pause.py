"""Pausing generation (vLLM's `pause_generation` / `resume_generation`, SGLang's `pause_generation` /
`continue_generation`): an RL loop stops the engine between two tokens of its rollouts, gives it new weights
(atlasjax/weight_update.py) and lets it go on.

What happens to the requests in flight when the pause comes is the pause's mode:
- "abort": they end now, each with a last delta of finish_reason "abort" (any text held back for a stop string
  included); the caller keeps what they generated;
- "wait": they run to completion, and the pause takes effect once the last has finished;
- "keep": they stop where they are, holding their pages and slots, and go on at `resume`.

Requests that arrive during a pause wait in the queue until `resume` (in "wait" mode too: only those in flight
before it run). `clear_cache` forgets the prefix cache once the pause takes effect; in "keep" mode it also drops
the kept requests' K/V (they are preempted, and compute their prompt and tokens so far again at resume), so that
every token after resume comes from the weights given meanwhile alone. Without it they go on over K/V the old
weights wrote (vLLM's partial rollouts).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from atlasjax.errors import InvalidRequestError
from atlasjax.outputs import StreamDelta

if TYPE_CHECKING:
    from atlasjax.engine import LLMEngine

MODES = ("abort", "wait", "keep")


class PauseState:
    """An engine's pause: its mode (None while generating), whether it has taken effect (`settled`: no step runs
    until resume), and the callers waiting for that (`waiters`: command ids, answered by `answers`)."""

    def __init__(self):
        self.mode: str | None = None
        self.clear_cache = False
        self.settled = False
        self.waiters: list[str] = []

    @property
    def is_paused(self) -> bool:
        return self.mode is not None

    def answers(self) -> list[tuple[str, bool]]:
        """(command id, paused) for each caller waiting on a pause that has taken effect (True) or was called off by
        a resume before it did (False); each answered once."""
        if not self.waiters or (self.mode is not None and not self.settled):
            return []
        done, self.waiters = self.waiters, []
        return [(waiter, self.mode is not None) for waiter in done]


def pause(engine: LLMEngine, mode: str = "abort", clear_cache: bool = True) -> list[StreamDelta]:
    """Pause `engine` (see the module docstring); returns the deltas that ended requests ("abort"). It takes
    effect now unless requests must finish first ("wait"): `engine.pause_state.settled` says which."""
    if mode not in MODES:
        raise InvalidRequestError(f"pause mode must be one of {', '.join(MODES)}, got {mode!r}")
    state = engine.pause_state
    state.mode, state.clear_cache, state.settled = mode, bool(clear_cache), False
    if mode == "wait" and _left_to_finish(engine):
        return []
    return settle(engine)


def resume(engine: LLMEngine) -> None:
    """Go on: requests kept or held are scheduled again (a "wait" pause not taken effect yet is called off)."""
    state = engine.pause_state
    state.mode, state.settled = None, False
    engine.scheduler.held.clear()


def step_paused(engine: LLMEngine) -> list[StreamDelta] | None:
    """What `engine.step()` does while paused: None to step as usual ("wait": requests from before the pause are
    still running), else the deltas of settling the pause now (none once it has taken effect)."""
    state = engine.pause_state
    if state.settled:
        return []
    if state.mode == "wait" and _left_to_finish(engine):
        return None
    return settle(engine)


def settle(engine: LLMEngine) -> list[StreamDelta]:
    """Take the pause into effect: read back the step in flight, then end ("abort") or drop the K/V of
    ("keep" with clear_cache) the requests left, and forget the prefix cache if asked."""
    state = engine.pause_state
    deltas = engine.drain()
    scheduler = engine.scheduler
    if state.mode == "abort":
        for seqs in engine.requests.values():
            ended = [_aborted(engine, req) for req in seqs if not req.is_finished]
            engine.stats.num_aborted += bool(ended)
            deltas += ended
    elif state.mode == "keep" and state.clear_cache:
        for req in list(scheduler.running):
            scheduler.preempt(req)
    if state.clear_cache:
        engine.pool.reset_prefix_cache()
    state.settled = True
    return deltas


def _left_to_finish(engine: LLMEngine) -> bool:
    """Whether requests that were in flight when a "wait" pause came are still unfinished."""
    scheduler = engine.scheduler
    return (engine.has_step_in_flight or bool(scheduler.running)
            or any(req not in scheduler.held for req in scheduler.waiting))


def _aborted(engine: LLMEngine, req) -> StreamDelta:
    """End one sequence for an "abort" pause: its last delta carries the text it held back for stop strings."""
    engine.scheduler.finish(req, "abort")
    text, req.emitted_chars = req.text[req.emitted_chars:], len(req.text)
    return StreamDelta(req.parent_id, req.index, [], text, True, "abort", None, None, len(req.prompt_token_ids),
                       len(req.output_token_ids), req.num_cached_tokens or 0)

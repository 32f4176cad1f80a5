"""A dispatched step and its one blocking read back to the host.

`LaunchedStep` is what `StepLauncher.launch` (step_launch.py) dispatched (nothing waited for the device);
`arrays_to_read` starts the device-to-host copies of what the host will need at dispatch, and
`read_back` waits for them, returning a `HostOutput` laid out the same for every kind of step:
[num_steps, prefill rows (num_slots) then decode rows (the decode bucket's)].
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from atlasjax.request import Request
from atlasjax.sampling_params import MAX_LOGPROBS
from atlasjax.scheduler_output import SchedulerOutput
from atlasjax.speculative import num_accepted
from atlasjax.steps import StepOutput


@dataclasses.dataclass
class LaunchedStep:
    """A dispatched step whose outputs have not been read back yet."""
    sched: SchedulerOutput
    prefill: StepOutput | None
    decode: StepOutput | None
    record_prompt_logprobs: list[bool]     # per prefill chunk
    sample_rows: dict[Request, int]        # request -> row of its new token in [prefill rows | decode rows]
    with_logprobs: bool                    # some sampled row asked for logprobs: read them back too
    num_steps: int = 1                     # decode iterations the launched decode runs (1, or the compiled K)
    spans: list[tuple[int, int, int]] | None = None   # a speculative verify (in `decode`): per decode row, its
    # first row in the verify's output, its number of drafts and the positions its pages hold from its last token's
    reach: dict[Request, int] | None = None   # a verify: the tokens it may emit per request (its pending tokens)


@dataclasses.dataclass
class HostOutput:
    """A step's outputs on the host: [num_steps, prefill rows (num_slots) then decode rows (the decode's
    bucket)]; the prefill rows have one token, in iteration 0."""
    tokens: np.ndarray
    logprob: np.ndarray | None
    top_vals: np.ndarray | None
    top_ids: np.ndarray | None
    prompt: tuple | None     # (chosen [T], top_vals [T, K], top_ids [T, K]) of a prefill with prompt logprobs
    # a verify step's rounds per decode row: (drafts, accepted) of each round it emitted tokens in (its tokens
    # above are those rounds' accepted drafts and the token sampled after them, one after another)
    spec_rounds: list[list[tuple[int, int]]] | None = None


def arrays_to_read(step: LaunchedStep) -> list[jax.Array]:
    """Only what the host needs: tokens, and logprobs when some row asked for them."""
    arrays = []
    for out in (step.prefill, step.decode):
        if out is not None:
            arrays.append(out.tokens)
            arrays += [x for x in (out.inputs, out.advance, out.shift, out.proposed) if x is not None]
            if step.with_logprobs:
                arrays += [out.logprob, out.top_vals, out.top_ids]
    if step.prefill is not None and step.prefill.prompt is not None:
        arrays += list(step.prefill.prompt)
    return arrays


def start_copies(step: LaunchedStep) -> None:
    """Start the transfers at dispatch; they complete when the step does."""
    for x in arrays_to_read(step):
        x.copy_to_host_async()


def read_back(step: LaunchedStep, num_slots: int) -> HostOutput:
    """The one blocking device-to-host transfer of a step (returns once the step has run)."""
    k, n = MAX_LOGPROBS, step.num_steps
    want = [None if o is None else (o.tokens, (o.logprob, o.top_vals, o.top_ids) if step.with_logprobs else None)
            for o in (step.prefill, step.decode)]
    verify = None if step.spans is None else (step.decode.inputs, step.decode.advance, step.decode.shift,
                                                step.decode.proposed)
    got, prompt, verify = jax.device_get((want, None if step.prefill is None else step.prefill.prompt, verify))
    if step.spans is not None:
        return _verify_host(step.spans, got[1], *verify, num_slots)

    def steps_axis(x, rows, dtype, tail=()):   # -> [n, rows, *tail]: single-step outputs are iteration 0
        if x is None:
            return np.zeros((n, rows, *tail), dtype)
        x = x.reshape(-1, rows, *tail)
        return x if len(x) == n else np.concatenate([x, np.zeros((n - len(x), rows, *tail), dtype)])

    parts = [(None, None) if g is None else g for g in got]
    # the prefill part always spans num_slots rows (decode rows follow it); the decode part its bucket's rows
    widths = (num_slots, 0 if got[1] is None else got[1][0].shape[-1])
    host = HostOutput(np.concatenate([steps_axis(p[0], w, np.int32) for p, w in zip(parts, widths)], axis=1),
                      None, None, None, prompt)
    if step.with_logprobs:
        host.logprob, host.top_vals, host.top_ids = (
            np.concatenate([steps_axis(None if p[1] is None else p[1][j], w, dt, tail)
                            for p, w in zip(parts, widths)], axis=1)
            for j, dt, tail in ((0, np.float32, ()), (1, np.float32, (k,)), (2, np.int32, (k,))))
    return host


def _verify_host(spans: list[tuple[int, int, int]], got, inputs: np.ndarray, advance: np.ndarray | None,
                 shift: np.ndarray | None, proposed: np.ndarray | None, num_slots: int) -> HostOutput:
    """A verify step's rows ([T], or [rounds, T] with `advance` [rounds, requests]) laid out as a multi-step
    decode's: [most tokens a request emitted, num_slots + requests], request r's tokens down column num_slots + r:
    in each round, its accepted drafts (those equal to the token sampled before them) and the token after them.
    A round's drafts past the request's pages (verify_rounds.py) were not verified and are not counted; a pipelined
    launch's pages hold `shift` fewer positions than the spans say (they count from the tokens known at packing).
    n-gram drafts looked up on the device count as `proposed` [rounds, requests] says."""
    tokens, lps = got
    tokens, inputs = tokens.reshape(-1, tokens.shape[-1]), inputs.reshape(-1, inputs.shape[-1])
    taken, rounds = [], []   # per request: (round, first row, rows) of each round it emitted tokens in
    for r, (start, n, room) in enumerate(spans):
        room -= 0 if shift is None else int(shift[r])
        taken.append([])
        rounds.append([])
        done = 0
        for q in range(len(tokens)):
            if advance is None:
                emitted = 1 + num_accepted(tokens[q, start:start + n + 1], inputs[q, start + 1:start + 1 + n].tolist())
            else:
                emitted = int(advance[q, r])
            if not emitted:
                break   # it sat this round out, and so every later one
            taken[-1].append((q, start, emitted))
            rounds[-1].append((min(n, room - done - 1) if proposed is None else int(proposed[q, r]), emitted - 1))
            done += emitted
    depth, width = max(sum(e for _, _, e in t) for t in taken), num_slots + len(spans)

    def by_request(x, dtype, tail=()):
        x = x.reshape(*tokens.shape, *tail)
        out = np.zeros((depth, width, *tail), dtype)
        for r, t in enumerate(taken):
            if t:
                out[:sum(e for _, _, e in t), num_slots + r] = np.concatenate([x[q, s:s + e] for q, s, e in t])
        return out
    host = HostOutput(by_request(tokens, np.int32), None, None, None, None, rounds)
    if lps is not None:
        k = MAX_LOGPROBS
        host.logprob, host.top_vals, host.top_ids = (by_request(x, dt, tail) for x, dt, tail in
                                                     zip(lps, (np.float32, np.float32, np.int32), ((), (k,), (k,))))
    return host

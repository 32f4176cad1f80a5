"""Asynchronous scheduling on vs off: one engine, one workload, time per engine step and where it goes.

`timed_run` submits every request at once (greedy, ignore_eos, so each makes exactly its output
length) and steps the engine until all finish, timing each `step()` call. `compare` runs it with
async scheduling off and on, alternately, emptying the prefix cache between runs so every run
computes the same prompts. Per step (wall time / steps scheduled; also the median `step()` call,
a decode step when outputs are long): the part the engine thread spent blocked reading outputs
back (waiting for the device) and the rest (host work: scheduling, packing, dispatch,
detokenization, stop checks; also a dispatch that has to wait because the runtime's queue of
computations ahead of the device is full, as when one step admits many requests: one `admit`
computation each). Synchronous: step = host + device. Overlapped: step ~ max(host, device), and
the wait shrinks by the host work it hides.
"""
from __future__ import annotations

import time

import numpy as np

from atlasjax.bench.presets import progress
from atlasjax.bench.report import fmt, summarize, table


class _ScheduledSteps:
    """Counts non-empty scheduler outputs: the steps that ran on the device (an async engine also
    has step() calls that only read the last step back)."""

    def __init__(self, scheduler):
        self.count = 0
        schedule = scheduler.schedule

        def counted(**kw):
            out = schedule(**kw)
            self.count += not out.is_empty
            return out
        scheduler.schedule = counted


def timed_run(engine, reqs: list[tuple[list[int], int]], tag: str,
              counter: _ScheduledSteps) -> tuple[dict, list[list[int]]]:
    """reqs: [(prompt ids, output length)]. Returns (figures, output token ids per request)."""
    from atlasjax.sampling_params import SamplingParams  # noqa: PLC0415
    steps0, wait0 = counter.count, engine.stats.read_wait_seconds
    ids = [f"{tag}-{i}" for i in range(len(reqs))]
    t0 = time.perf_counter()
    for rid, (prompt, n_out) in zip(ids, reqs):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    seqs = [engine.requests[rid][0] for rid in ids]
    step_s = []
    while engine.has_unfinished():
        ts = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - ts)
    elapsed = time.perf_counter() - t0
    outputs = [list(r.output_token_ids) for r in seqs]
    for rid in ids:
        engine.release(rid)
    engine.pool.reset_prefix_cache()
    steps, wait = counter.count - steps0, engine.stats.read_wait_seconds - wait0
    n_out = sum(len(o) for o in outputs)
    figures = dict(async_scheduling=engine.async_scheduling, elapsed_s=elapsed, num_steps=steps,
                   num_step_calls=len(step_s), mean_step_s=elapsed / steps, host_per_step_s=(elapsed - wait) / steps,
                   wait_per_step_s=wait / steps, step_call_s=summarize(step_s), output_tokens=n_out,
                   output_tokens_per_s=n_out / elapsed)
    return figures, outputs


def compare(engine, reqs, repeats: int = 1) -> dict:
    """Alternate off / on `repeats` times; per-mode medians of the figures (a run disturbed by other work
    on the machine does not move them), every run's figures, and whether all outputs agree."""
    runs, outputs = {False: [], True: []}, []
    counter = _ScheduledSteps(engine.scheduler)
    engine.pool.reset_prefix_cache()
    for r in range(repeats):
        for mode in (False, True):
            engine.async_scheduling = mode
            fig, out = timed_run(engine, reqs, f"{'async' if mode else 'sync'}{r}", counter)
            progress(f"async scheduling {'on ' if mode else 'off'}: {fig['mean_step_s'] * 1e3:.2f} ms/step, "
                     f"{fig['output_tokens_per_s']:.1f} output tok/s ({fig['num_steps']} steps)")
            runs[mode].append(fig)
            outputs.append(out)
    engine.async_scheduling = engine.config.async_scheduling

    def median(mode, key):
        return float(np.median([f[key] for f in runs[mode]]))
    for fig in runs[False] + runs[True]:
        fig["median_step_call_s"] = fig["step_call_s"]["median"]
    keys = ("mean_step_s", "median_step_call_s", "host_per_step_s", "wait_per_step_s", "output_tokens_per_s",
            "num_steps")
    summary = {f"{k}_{'on' if m else 'off'}": median(m, k) for k in keys for m in (False, True)}
    summary["step_time_ratio_on_over_off"] = summary["mean_step_s_on"] / summary["mean_step_s_off"]
    summary["outputs_identical"] = all(o == outputs[0] for o in outputs)
    return dict(summary=summary, runs={"off": runs[False], "on": runs[True]}, repeats=repeats)


def compare_table(c: dict, label: str) -> str:
    s = c["summary"]
    rows = [[name, fmt(s[f"{key}_off"], "", scale), fmt(s[f"{key}_on"], "", scale),
             fmt(s[f"{key}_on"] / s[f"{key}_off"] if s[f"{key}_off"] else None, "x")]
            for name, key, scale in (("time per step (ms)", "mean_step_s", 1e3),
                                     ("  median step() call (ms)", "median_step_call_s", 1e3),
                                     ("  host work + dispatch per step (ms)", "host_per_step_s", 1e3),
                                     ("  blocked on read-back per step (ms)", "wait_per_step_s", 1e3),
                                     ("output tok/s", "output_tokens_per_s", 1),
                                     ("steps scheduled", "num_steps", 1))]
    rows.append(["outputs identical", "", "", "yes" if s["outputs_identical"] else "NO"])
    return table(f"async scheduling off vs on: {label} (median of {c['repeats']} run(s) each)",
                 ["figure", "off", "on", "on / off"], rows)

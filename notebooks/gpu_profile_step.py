"""GPU: where one decode step's time goes (Llama-3.1-8B shapes, random weights, bs=1).

Runs engine steps in steady state (async scheduling, tokens read back each step, as the bench does),
then a `jax.profiler` trace of STEPS steps, and reports per step: wall time, GPU busy time (union of
kernel intervals), idle time between kernels, kernel count, kernels that start before the previous one ends (and by
how much: programmatic dependent launch), and the kernels grouped by name.
The same decode step dispatched back to back with inputs already on the device gives the floor.

  JAX_PLATFORMS=cuda QUANT=int8 [LM_HEAD=1] [SCHED_STEPS=4] python notebooks/gpu_profile_step.py   (QUANT empty: bf16;
  QUANT=gguf-q4_k_m etc.: laid out as that GGUF type loads, atlasjax/bench/gguf_layouts.py;
  LM_HEAD=1 quantizes the LM head too, as `bench --quantize-lm-head` does)
Writes $OUT/profile_<quant or bf16><TAG>.json.
"""
import collections
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.sampling_params import SamplingParams
from atlasjax.step_options import use_process_flags

sys.path.insert(0, os.path.dirname(__file__))
import trace_events  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
QUANT = os.environ.get("QUANT") or None
PRESET = os.environ.get("PRESET", "llama-3.1-8b")
BS = int(os.environ.get("BS", "1"))
TP = int(os.environ.get("TP", "1"))
LM_HEAD = os.environ.get("LM_HEAD") == "1"
SCHED_STEPS = int(os.environ.get("SCHED_STEPS", "1"))   # decode steps per launch (engine_trace counts per launch)
use_process_flags(TP)   # as the engine would, before jax starts (atlasjax/step_options.py)
STEPS = 10
NAME = f"profile_{QUANT or 'bf16'}_bs{BS}_tp{TP}{os.environ.get('TAG', '')}"
res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "preset": PRESET, "quant": QUANT,
       "lm_head_quantized": LM_HEAD, "bs": BS, "tp": TP, "steps_per_launch": SCHED_STEPS,
       "xla_flags": os.environ.get("XLA_FLAGS", ""),   # after use_process_flags
       "env": {k: v for k, v in os.environ.items() if k.startswith("ATLASJAX_")}}


def log(key, value):
    res[key] = value
    print(key, json.dumps(value), flush=True)
    with open(f"{OUT}/{NAME}.json", "w") as f:
        json.dump(res, f, indent=1)


def analyse(trace_dir, steps):
    gpu, events, names = trace_events.load(trace_dir)
    if not gpu:
        return {"error": "no GPU events", "processes": sorted(set(names.values()))[:20]}
    tl = trace_events.timeline(gpu)
    busy, span, gap_before, overlaps, overlap_us = (tl[k] for k in ("busy", "span", "gap_before", "overlaps",
                                                                     "overlap_us"))
    gaps = [g for g in gap_before[1:] if g >= 0]   # idle time before each kernel that starts after the rest end
    by_name = collections.Counter()
    count = collections.Counter()
    by_cat = collections.Counter()
    for e in gpu:
        by_name[e["name"][:90]] += e["dur"]
        count[e["name"][:90]] += 1
        by_cat[trace_events.category(e["name"])] += e["dur"]
    big_gaps = sorted(gaps, reverse=True)[:12]
    # The kernels around each decode attention kernel (offsets -2..+4), median duration by offset:
    # what a change to the attention kernel costs it and what it does to its neighbours (o_proj).
    around = collections.defaultdict(list)
    for j, e in enumerate(gpu):
        if "paged_decode_attention" in e["name"]:
            for off in range(-2, 5):
                if 0 <= j + off < len(gpu):
                    around[off].append((gpu[j + off]["name"][:60], gpu[j + off]["dur"]))
    around_attention = {off: {"us_median": float(np.median([d for _, d in v])),
                              "names": collections.Counter(n for n, _ in v).most_common(2)}
                        for off, v in sorted(around.items())}
    # One layer, attention to attention: each position's kernel and its median duration over the
    # middle layers, so a routing change shows per kernel.
    starts = [j for j, e in enumerate(gpu) if "paged_decode_attention" in e["name"]]
    spans = [gpu[a:b] for a, b in zip(starts, starts[1:]) if b - a == starts[len(starts) // 2 + 1] - starts[len(starts) // 2]]
    one_layer = [(spans[0][p]["name"][:60], round(float(np.median([s[p]["dur"] for s in spans])), 2))
                 for p in range(len(spans[0]))] if spans else []
    # The idle time before each of those kernels (median over the same layers): launch gaps the busy
    # time does not count, so a kernel that is shorter but starts later shows here.
    layer_starts = [a for a, b in zip(starts, starts[1:]) if b - a == len(spans[0])] if spans else []
    gaps_in_layer = [(spans[0][p]["name"][:40], round(float(np.median([gap_before[a + p] for a in layer_starts])), 2))
                     for p in range(len(spans[0]))] if spans else []
    host = collections.Counter()
    host_n = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and "host" in names.get(e["pid"], "").lower():
            host[e["name"][:70]] += e["dur"]
            host_n[e["name"][:70]] += 1
    return {"span_ms_per_step": span / 1e3 / steps, "busy_ms_per_step": busy / 1e3 / steps,
            "idle_ms_per_step": (span - busy) / 1e3 / steps, "kernels_per_step": len(gpu) / steps,
            "overlapping_kernels_per_step": overlaps / steps, "overlap_ms_per_step": overlap_us / 1e3 / steps,
            "gaps_over_5us_per_step": sum(1 for g in gaps if g > 5) / steps,
            "gap_ms_over_5us_per_step": sum(g for g in gaps if g > 5) / 1e3 / steps,
            "largest_gaps_us": [round(g, 1) for g in big_gaps],
            "around_attention": around_attention, "one_layer": one_layer,
            "gaps_in_layer_us": gaps_in_layer, "layer_gap_us": round(sum(g for _, g in gaps_in_layer), 2),
            "by_category_ms_per_step": {k: round(v / 1e3 / steps, 4) for k, v in by_cat.most_common()},
            "top_kernels": [(n, count[n] / steps, round(d / 1e3 / steps, 4)) for n, d in by_name.most_common(40)],
            "top_host_events": [(n, host_n[n] / steps, round(d / 1e3 / steps, 4)) for n, d in host.most_common(40)]}


t0 = time.perf_counter()
engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=max(BS, 8), max_model_len=1024, page_size=16,
                                num_pages=max(BS, 8) * 16 + 8, max_num_batched_tokens=512, tensor_parallel_size=TP,
                                num_scheduler_steps=SCHED_STEPS),
                   load_preset(PRESET, jnp.bfloat16, QUANT, 0, TP, quantize_lm_head=LM_HEAD))
log("load_s", round(time.perf_counter() - t0, 1))
rng = np.random.default_rng(0)
params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
for i in range(BS):
    engine.add_request(f"r{i}", rng.integers(0, engine.model_config.vocab_size, 128).tolist(), params)
reqs = [engine.requests[f"r{i}"][0] for i in range(BS)]
while not all(len(r.output_token_ids) >= 2 for r in reqs):
    engine.step()
for _ in range(8):
    engine.step()
times = []
for _ in range(40):
    t = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - t)
log("engine_step_ms", {"median": 1e3 * float(np.median(times)), "p10": 1e3 * float(np.percentile(times, 10)),
                       "p90": 1e3 * float(np.percentile(times, 90))})

jax.profiler.start_trace("/tmp/trace_engine", create_perfetto_trace=True)
for _ in range(STEPS):
    engine.step()
jax.profiler.stop_trace()
log("engine_trace", analyse("/tmp/trace_engine", STEPS))
if SCHED_STEPS > 1:   # the floor below dispatches the one-step executable
    raise SystemExit

# Host cost of one step without the device: time spent in engine.step() minus time blocked on the read-back
# is not separable here; instead, dispatch the compiled decode back to back with device inputs (the floor).
r = engine.runner
s = engine.num_slots
step_fn = next(v for k, v in r._compiled.items() if k[0] == "decode" and k[1] == s and k[2].greedy and not k[2].logprobs)
pt = np.zeros((s, r.pages_per_seq), np.int32)
pt[:, :9] = np.arange(9 * s).reshape(s, 9)
lens = np.zeros(s, np.int32)
lens[:BS] = 140
from atlasjax.sampling import pack_rows  # noqa: E402

f, i = pack_rows([(SamplingParams(temperature=0), 0, 0, ())] * BS, s)
from atlasjax.steps import pack_host  # noqa: E402

packed = r._on_mesh(jnp.asarray(pack_host((np.ones(s, np.int32), pt, lens, np.arange(s, dtype=np.int32), f, i))[0]))   # replicated under TP
z = r._on_mesh(jnp.zeros((s,), jnp.int32))


def floor_steps(n):
    for _ in range(n):
        r.state, out = step_fn(r.params, r.state, packed, z, z)
    return out


jax.block_until_ready(floor_steps(3))
# Host cost of the runner alone: decode calls with numpy inputs (as the engine makes them), not waited on.
plan_key = next(k[2] for k in r._compiled if k[0] == "decode" and k[1] == s and k[2].greedy and not k[2].logprobs)
host = [np.ones(s, np.int32), pt, lens]
outs = []
t = time.perf_counter()
for _ in range(20):
    outs.append(r.decode(*host, f, i, plan=plan_key).tokens)
log("runner_dispatch_ms", 1e3 * (time.perf_counter() - t) / 20)
jax.block_until_ready(outs)
t = time.perf_counter()
jax.block_until_ready(floor_steps(30))
log("device_inputs_back_to_back_ms", 1e3 * (time.perf_counter() - t) / 30)

jax.profiler.start_trace("/tmp/trace_floor", create_perfetto_trace=True)
jax.block_until_ready(floor_steps(STEPS))
jax.profiler.stop_trace()
log("floor_trace", analyse("/tmp/trace_floor", STEPS))

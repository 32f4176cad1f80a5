"""GPU: where a prefill's time goes (Llama-3.1-8B shapes, random weights).

CASES, comma-separated WEIGHTS:LENxPROMPTS[:max_model_len], e.g. "bf16:2048x1,bf16:128x64,w8a8:128x64". WEIGHTS:
bf16; fp8 (fp8 weights and LM head, bf16 activations: W8A16); w8a8 (the same with fp8 activations, as `bench
--quantization fp8 --quantize-lm-head --activation-quantization fp8`). Each case prefills PROMPTS fresh random
prompts of LEN tokens in one engine step (max_tokens=1), times ITERS of them after two untimed ones, profiles
the host's first engine step of three (cProfile), then traces three with `jax.profiler` and reports per
prefill: wall, GPU busy and idle time, kernels by category, the gaps between kernels, and one layer's kernels
in order (median us over the layers) with TFLOP/s for the four projections, whose FLOPs the shapes give.

  JAX_PLATFORMS=cuda CASES=bf16:2048x1 python notebooks/gpu_profile_prefill.py     # -> $OUT/profile_prefill.json
"""
import collections
import cProfile
import io
import json
import os
import pstats
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench.presets import load_preset, PRESETS
from atlasjax.bench.roofline import measure_ceilings
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.sampling_params import SamplingParams
from atlasjax.step_options import use_process_flags

sys.path.insert(0, os.path.dirname(__file__))
import trace_events  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
CASES = os.environ.get("CASES", "bf16:2048x1,bf16:128x64,w8a8:2048x1,w8a8:128x64")   # optional :max_model_len
PRESET = os.environ.get("PRESET", "llama-3.1-8b")   # tiny: a CPU smoke run of the script
ITERS = int(os.environ.get("ITERS", "5"))
TRACED = 3
use_process_flags(1)
res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cases": {}}


def save():
    with open(f"{OUT}/profile_prefill.json", "w") as f:
        json.dump(res, f, indent=1)


def prefill_all(engine, rng, length, prompts, profile=None):
    """Prefill `prompts` fresh prompts; (wall seconds, ms per engine step); profile: a cProfile.Profile run over
    each first step (scheduling, admission, packing and dispatch: the host's work before the device starts)."""
    for i in range(prompts):
        prompt = rng.integers(0, PRESETS[PRESET].vocab_size, length).tolist()
        engine.add_request(f"p{time.perf_counter_ns()}_{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    step_ms = []
    while engine.has_unfinished():
        s = time.perf_counter()
        if profile is not None and not step_ms:
            profile.runcall(engine.step)
        else:
            engine.step()
        step_ms.append(round(1e3 * (time.perf_counter() - s), 2))
    return time.perf_counter() - t, step_ms


def projection_flops(tokens):
    c = PRESETS[PRESET]
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    return {"qkv": 2 * tokens * d * hd * (c.num_heads + 2 * c.num_kv_heads),
            "o_proj": 2 * tokens * hd * c.num_heads * d, "gate_up": 2 * tokens * d * 2 * f, "down": 2 * tokens * f * d}


def analyse(tokens):
    gpu, _, names = trace_events.load("/tmp/trace_prefill")
    if not gpu:
        return {"error": "no GPU events", "processes": sorted(set(names.values()))[:20]}
    tl = trace_events.timeline(gpu)
    busy, span = tl["busy"], tl["span"]
    gap_before = [max(0.0, g) for g in tl["gap_before"]]   # per kernel: idle time since the kernels before it ended
    by_cat, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in gpu:
        by_cat[trace_events.category(e["name"])] += e["dur"]
        by_name[e["name"][:90]] += e["dur"]
        count[e["name"][:90]] += 1
    # one layer: from one prefill attention kernel to the next, median over the spans of the usual length
    starts = [j for j, e in enumerate(gpu) if "ragged_paged_attention" in e["name"]]
    lengths = collections.Counter(b - a for a, b in zip(starts, starts[1:]))
    usual = lengths.most_common(1)[0][0] if lengths else 0
    spans = [gpu[a:b] for a, b in zip(starts, starts[1:]) if b - a == usual]
    one_layer = [(spans[0][p]["name"][:70], round(float(np.median([s[p]["dur"] for s in spans])), 2))
                 for p in range(usual)] if spans else []
    layer_starts = [a for a, b in zip(starts, starts[1:]) if b - a == usual]
    gaps_in_layer = [(spans[0][p]["name"][:40], round(float(np.median([gap_before[a + p] for a in layer_starts])), 2))
                     for p in range(usual)] if spans else []
    order = sorted(range(len(gpu)), key=lambda j: -gap_before[j])[:15]
    largest = [(round(gap_before[j], 1), gpu[j - 1]["name"][:40], gpu[j]["name"][:40]) for j in sorted(order)]
    small = sum(g for g in gap_before if g < 100)
    gemms = [(n, us) for n, us in one_layer if trace_events.category(n) in ("gemm", "quantized_matmul")]
    flops = projection_flops(tokens)
    # a layer's projections run in the order o_proj (after attention), gate_up, down, qkv (before the next attention)
    rates = {}
    if len(gemms) >= 4:
        big = sorted(range(len(gemms)), key=lambda i: -gemms[i][1])[:4]
        for proj, i in zip(("o_proj", "gate_up", "down", "qkv"), sorted(big)):
            rates[proj] = {"us": gemms[i][1], "tflops": round(flops[proj] / gemms[i][1] / 1e6, 1)}
    per = TRACED
    return {"span_ms": span / 1e3 / per, "busy_ms": busy / 1e3 / per, "idle_ms": (span - busy) / 1e3 / per,
            "kernels": len(gpu) / per, "attention_kernels": len(starts) / per,
            "by_category_ms": {k: round(v / 1e3 / per, 3) for k, v in by_cat.most_common()},
            "one_layer_us": one_layer, "gaps_in_layer_us": gaps_in_layer,
            "layer_gap_us": round(sum(g for _, g in gaps_in_layer), 1),
            "gaps_under_100us_ms": round(small / 1e3 / per, 3), "largest_gaps_us": largest,
            "layer_us": round(sum(us for _, us in one_layer), 1), "projections": rates,
            "top_kernels": [(n, count[n] / per, round(d / 1e3 / per, 3)) for n, d in by_name.most_common(25)]}


res["ceilings"] = measure_ceilings()
save()
for case in CASES.split(","):
    weights, shape, *max_len = case.split(":")   # a third field: max_model_len
    length, prompts = map(int, shape.split("x"))
    tokens = length * prompts
    max_model_len = int(max_len[0]) if max_len else max(length + 16, 256)
    fp8 = weights in ("w8a8", "fp8")   # fp8: fp8 weights and LM head, bf16 activations (W8A16)
    acts = "fp8" if weights == "w8a8" else None
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=max(prompts, 8), max_model_len=max_model_len,
                                    page_size=16, num_pages=tokens // 16 + 64, max_num_batched_tokens=tokens,
                                    enable_prefix_caching=False, quantization="fp8" if fp8 else None,
                                    activation_quantization=acts, quantize_lm_head=fp8),
                       load_preset(PRESET, jnp.bfloat16, "fp8" if fp8 else None, 0, 1, quantize_lm_head=fp8))
    rng = np.random.default_rng(0)
    warm = [prefill_all(engine, rng, length, prompts) for _ in range(2)]
    timed = [prefill_all(engine, rng, length, prompts) for _ in range(ITERS)]
    times = [t for t, _ in timed]
    r = {"tokens": tokens, "start_s": round(time.perf_counter() - t0, 1), "warm_s": [round(w[0], 2) for w in warm],
         "step_ms": [s for _, s in timed], "wall_ms_median": round(1e3 * float(np.median(times)), 2),
         "wall_ms": [round(1e3 * t, 2) for t in times]}
    host = cProfile.Profile()
    for _ in range(3):
        prefill_all(engine, rng, length, prompts, host)
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
    r["host_first_step_profile"] = text.getvalue().splitlines()[-40:]
    jax.profiler.start_trace("/tmp/trace_prefill")
    for _ in range(TRACED):
        prefill_all(engine, rng, length, prompts)
    jax.profiler.stop_trace()
    r.update(analyse(tokens))
    layer_flops = sum(projection_flops(tokens).values()) * PRESETS[PRESET].num_layers   # attention's FLOPs not counted
    r["projection_tflops_over_wall"] = round(layer_flops / (r["wall_ms_median"] / 1e3) / 1e12, 1)
    res["cases"][case] = r
    save()
    keys = ("wall_ms_median", "step_ms", "busy_ms", "idle_ms", "gaps_under_100us_ms", "layer_gap_us",
            "by_category_ms", "projections", "layer_us", "projection_tflops_over_wall")
    print(case, json.dumps({k: r.get(k) for k in keys}), flush=True)
    del engine
    os.system("rm -rf /tmp/trace_prefill")

"""GPU: tensor parallelism on 2 GPUs with a Llama-3.1-8B-shaped model (random weights, same values at any TP).

MODE=bf16 (default): for TP=1 and TP=2: greedy generations (4 prompts x 32 tokens, Pallas kernels),
decode step time at bs=1 and bs=32 (engine.step() in steady state, tokens read back every step),
and per-step all-reduce time from a profiler trace. MODE=f32: greedy equality in float32 (reference
attention), where rounding cannot flip near-ties. QUANT=int8|fp8|int4 quantizes the random weights
(LM head included) before they are split. CONTROL=splits (with QUANT) runs TP=1 a second time with
each quantized kernel's K split changed, to show how far summation order alone moves greedy
outputs. Writes $OUT/tp_<mode>[_<quant>].json.

  JAX_PLATFORMS=cuda MODE=bf16 [QUANT=int4] python notebooks/gpu_tensor_parallel.py
"""
import collections
import gc
import glob
import gzip
import json
import os
import re
import time
from unittest import mock

import jax
import jax.numpy as jnp

if os.environ.get("MODE") == "f32":   # true f32 matmuls (no TF32), so only summation order differs
    jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np

from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.llm import LLM
from atlasjax.sampling_params import SamplingParams
from atlasjax.step_options import use_process_flags
from pallas_kernels import gemm_tiling
from pallas_kernels import quantized_matmul as qmm

OUT = os.environ.get("OUT", "/tmp")
MODE = os.environ.get("MODE", "bf16")
PRESET = os.environ.get("PRESET", "llama-3.1-8b")
TPS = [int(t) for t in os.environ.get("TPS", "1,2").split(",")]
use_process_flags(max(TPS))   # as the engine would, before jax starts (atlasjax/step_options.py)
QUANT = os.environ.get("QUANT") or None
res = {"device": jax.devices()[0].device_kind, "num_devices": len(jax.devices()), "jax": jax.__version__,
       "preset": PRESET, "mode": MODE, "quantization": QUANT, "xla_flags": os.environ.get("XLA_FLAGS", "")}


def log(key, value):
    res[key] = value
    print(key, json.dumps(value), flush=True)
    with open(f"{OUT}/tp_{MODE}{'_' + QUANT if QUANT else ''}.json", "w") as f:
        json.dump(res, f, indent=1)


def make_engine(tp, seqs):
    dtype = "bfloat16" if MODE == "bf16" else "float32"
    loaded = load_preset(PRESET, jnp.dtype(dtype), QUANT, 0, tp, quantize_lm_head=QUANT is not None)
    cfg = EngineConfig(num_scheduler_steps=1, dtype=dtype, max_num_seqs=seqs, max_model_len=1024,
                       num_pages=seqs * 16 + 8, page_size=16, max_num_batched_tokens=512, tensor_parallel_size=tp)
    return LLMEngine(cfg, loaded)


def greedy(engine):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.model_config.vocab_size, 32).tolist() for _ in range(4)]
    outs = LLM.from_engine(engine).generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                                      logprobs=0))
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


def decode_steps(engine, bs, steps=24, trace_dir=None):
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    ids = [f"t{bs}-{i}" for i in range(bs)]
    for rid in ids:
        engine.add_request(rid, rng.integers(0, engine.model_config.vocab_size, 128).tolist(), params)
    reqs = [engine.requests[r][0] for r in ids]
    while not all(len(r.output_token_ids) >= 2 for r in reqs):
        engine.step()
    for _ in range(4):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    collective = None
    if trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(8):
            engine.step()
        jax.profiler.stop_trace()
        collective = collective_time(trace_dir, 8)
    for rid in ids:
        engine.abort(rid)
    return {"bs": bs, "step_ms_median": 1e3 * float(np.median(times)), "step_ms_mean": 1e3 * float(np.mean(times)),
            "collectives": collective}


def collective_time(trace_dir, steps):
    """Per device: ms per step in all-reduce / all-gather kernels, and the busiest kernels."""
    files = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    if not files:
        return {"error": "no perfetto trace written"}
    with gzip.open(sorted(files)[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    per_pid = collections.defaultdict(lambda: collections.Counter())
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            per_pid[e["pid"]][e["name"]] += e["dur"]
    out = {}
    pat = re.compile(r"all-?reduce|all-?gather|nccl|psum|collective", re.I)
    for pid, counter in per_pid.items():
        name = names.get(pid, str(pid))
        if "gpu" not in name.lower() and "/device" not in name.lower():
            continue
        coll = sum(d for n, d in counter.items() if pat.search(n))
        out[name] = {"collective_ms_per_step": coll / 1e3 / steps,
                     "all_kernels_ms_per_step": sum(counter.values()) / 1e3 / steps,
                     "collective_kernels": sorted({n[:60] for n in counter if pat.search(n)})[:10],
                     "top": [(n[:80], round(d / 1e3 / steps, 4)) for n, d in counter.most_common(25)]}
    return out


def compare(key, tokens, lps, ref_tokens, ref_lps):
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(tokens, ref_tokens)]
    n = [min(s, len(a)) for s, a in zip(same, lps)]
    diff = max(float(np.max(np.abs(np.array(a[:k]) - np.array(b[:k])))) if k else 0.0
               for a, b, k in zip(lps, ref_lps, n))
    log(key, {"equal": tokens == ref_tokens, "matching_prefix": same, "max_logprob_diff_on_prefix": diff})


def other_k_splits(num_steps, num_blocks, *, requested, max_auto):
    """The next divisor of num_steps after the automatic split (a different summation order)."""
    auto = gemm_tiling.k_splits(num_steps, num_blocks, requested=requested, max_auto=max_auto)
    return next((d for d in range(auto + 1, num_steps + 1) if num_steps % d == 0), 1)


results = {}
if os.environ.get("CONTROL") == "splits":
    ref = greedy(make_engine(1, 4))
    with mock.patch.object(qmm, "k_splits", other_k_splits):
        jax.clear_caches()
        compare("tp1_other_k_splits_vs_tp1", *greedy(make_engine(1, 4)), *ref)
    TPS = []
for tp in TPS:
    t0 = time.perf_counter()
    engine = make_engine(tp, 32 if MODE == "bf16" else 4)
    log(f"tp{tp}_load_s", round(time.perf_counter() - t0, 1))
    t0 = time.perf_counter()
    tokens, lps = greedy(engine)
    log(f"tp{tp}_greedy_s", round(time.perf_counter() - t0, 1))
    results[tp] = (tokens, lps)
    if tp != TPS[0]:
        compare(f"tp{tp}_vs_tp{TPS[0]}", tokens, lps, *results[TPS[0]])
    if MODE == "bf16":
        for bs in (1, 32):
            log(f"tp{tp}_bs{bs}", decode_steps(engine, bs, trace_dir=f"/tmp/trace_tp{tp}_bs{bs}"))
    del engine
    gc.collect()
if MODE == "bf16" and 1 in TPS and 2 in TPS:
    log("tp2_over_tp1_bs1", res["tp2_bs1"]["step_ms_median"] / res["tp1_bs1"]["step_ms_median"])
    log("tp2_over_tp1_bs32", res["tp2_bs32"]["step_ms_median"] / res["tp1_bs32"]["step_ms_median"])

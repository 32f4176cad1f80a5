"""Where lowering a step program goes: cProfile of `ModelRunner._lower` for decode programs that
differ only in their sampling plan (the layers' kernels are the same in each).

GPU: `PRESET=llama-3.1-8b QUANT=int4 python notebooks/gpu_lower_profile.py`
CPU check: `PRESET=tiny python notebooks/gpu_lower_profile.py`
Prints each lowering's seconds and the top functions by cumulative time of the last one.
"""
from __future__ import annotations

import cProfile
import functools
import io
import os
import pstats
import time

import numpy as np

from atlasjax import sampling
from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig

PRESET, QUANT = os.environ.get("PRESET", "tiny"), os.environ.get("QUANT")

loaded = load_preset(PRESET, "bfloat16", QUANT, 0)
engine = LLMEngine(EngineConfig(max_num_seqs=8, max_model_len=256, num_pages=64, dtype="bfloat16"), loaded=loaded)
runner = engine.runner
z = functools.partial(np.zeros, dtype=np.int32)
f, i = sampling.pack_rows([], 8)
host = (z(8), z((8, runner.pages_per_seq)), z(8), z(8), f, i)
specs = [runner.decode_spec(host, (runner.no_prev_tokens,) * 2, plan) for plan in sampling.SamplingPlan.variants()]
for spec in specs[:-1]:
    t0 = time.perf_counter()
    runner._lower(spec)
    print(f"lower {spec.key}: {time.perf_counter() - t0:.2f} s", flush=True)
profile = cProfile.Profile()
t0 = time.perf_counter()
profile.runcall(runner._lower, specs[-1])
print(f"lower {specs[-1].key} (profiled): {time.perf_counter() - t0:.2f} s")
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(45)
print(out.getvalue())
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
print(out.getvalue())

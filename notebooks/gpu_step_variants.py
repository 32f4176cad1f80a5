"""GPU: the bs=1 decode step under variants that need no code change, each in its own process.

A variant is a set of XLA flags and/or a patch of a tunable default (the attention's context
split count). Each runs `python -m atlasjax.bench latency` in a fresh process (XLA flags are read
once per process) and the script collects TPOT median / p10 and the wall time of the run.

  JAX_PLATFORMS=cuda [VARIANTS=base,exhaustive] [QUANT=int8] [BENCH_ARGS="..."] \
      python notebooks/gpu_step_variants.py
Writes $OUT/step_variants<TAG>.json.
"""
import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT", "/tmp")
QUANT = os.environ.get("QUANT") or None
VARIANTS = {
    "base": ({}, None),
    "exhaustive": ({"XLA_FLAGS": "--xla_gpu_exhaustive_tiling_search=true"}, None),
    "splits1": ({}, "splits1"),
    "exhaustive_splits1": ({"XLA_FLAGS": "--xla_gpu_exhaustive_tiling_search=true"}, "splits1"),
    "no_triton_gemm": ({"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}, None),
}
PATCHES = {
    # one context split per (sequence, KV head): no split-combine kernel after the attention
    "splits1": "import pallas_kernels.paged_attention as pa; pa._default_num_splits = lambda *a, **k: 1",
}
ARGS = ["latency", "--preset", "llama-3.1-8b", "--input-len", "128", "--output-len", "128",
        "--num-iters", "3", "--batch-size", "1"] + os.environ.get("BENCH_ARGS", "").split()
if QUANT:
    ARGS += ["--quantization", QUANT]

res = {"args": ARGS, "variants": {}}
names = [v for v in os.environ.get("VARIANTS", ",".join(VARIANTS)).split(",") if v]
for name in names:
    env_extra, patch = VARIANTS[name]
    out_json = f"{OUT}/variant_{name}.json"
    code = (f"{PATCHES[patch]}\n" if patch else "") + (
        "import sys\nfrom atlasjax.bench.__main__ import main\n"
        f"sys.exit(main({ARGS + ['--output', out_json]!r}))")
    env = dict(os.environ, **env_extra)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    row = {"rc": proc.returncode, "wall_s": round(wall, 1), "env": env_extra, "patch": patch}
    if proc.returncode == 0:
        with open(out_json) as f:
            rep = json.load(f)
        row["results"] = rep.get("results", rep)
    else:
        row["stderr_tail"] = proc.stderr[-3000:]
    res["variants"][name] = row
    print(name, json.dumps({k: v for k, v in row.items() if k != "results"}), flush=True)
    print(proc.stdout[-2500:], flush=True)
    with open(f"{OUT}/step_variants{os.environ.get('TAG', '')}.json", "w") as f:
        json.dump(res, f, indent=1)

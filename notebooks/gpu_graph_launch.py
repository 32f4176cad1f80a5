"""GPU: what launching one XLA command buffer (CUDA graph) costs the host, against its node count.

A decode step is one CUDA graph of ~400-600 kernel nodes, and `cuGraphLaunch` took 1.2-2 ms of
host time per launch in every profile (docs/performance.md, sessions 4 and 16). This separates
the graph's size from what its kernels are: chains of N tiny kernels, each its own node
(optimization barriers keep XLA from fusing them), of two kinds:
- `xla`: an XLA elementwise fusion per node;
- `mosaic`: a trivial Mosaic GPU kernel per node (a custom call, as the engine's Pallas kernels are).
Per N: host time to issue one call (until it returns; the previous result is waited on first), and
from a profiler trace the host events per call (`cuGraphLaunch`, `command_buffer::*`, Thunks).

  JAX_PLATFORMS=cuda python notebooks/gpu_graph_launch.py      (writes $OUT/graph_launch.json)
"""
import collections
import glob
import gzip
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

OUT = os.environ.get("OUT", "/tmp")
SIZES = [int(n) for n in os.environ.get("SIZES", "64,256,512,1024").split(",")]
KINDS = os.environ.get("KINDS", "xla,mosaic").split(",")
res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
       "runs": []}


def add_one_mosaic(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def chain(kind, n):
    def f(x):
        for _ in range(n):
            x = add_one_mosaic(x) if kind == "mosaic" else x * 1.0001 + 1.0
            x = jax.lax.optimization_barrier(x)
        return x
    return jax.jit(f)


def host_events(trace_dir, calls):
    files = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(max(files)) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    host, host_n, kernels = collections.Counter(), collections.Counter(), 0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        proc = names.get(e["pid"], "").lower()
        if "host" in proc:
            host[e["name"][:50]] += e["dur"]
            host_n[e["name"][:50]] += 1
        elif "gpu" in proc or "/device" in proc:
            kernels += 1
    keep = ("cuGraph", "command_buffer", "Thunks", "Execute", "cuLaunch")
    return {"kernels_per_call": kernels / calls,
            "host_us_per_call": {n: (host_n[n] / calls, round(d / calls, 1)) for n, d in host.most_common(60)
                                 if any(k in n for k in keep)}}


x = jnp.zeros((8, 128), jnp.float32)
for kind in KINDS:
    for n in SIZES:
        fn = chain(kind, n)
        t0 = time.perf_counter()
        y = fn(x).block_until_ready()
        row = {"kind": kind, "nodes": n, "compile_s": round(time.perf_counter() - t0, 1)}
        if kind == "mosaic":
            row["all_kernels_ran"] = bool(np.all(np.asarray(y) == n))
        for _ in range(5):
            fn(x).block_until_ready()
        issue, total = [], []
        for _ in range(40):
            t = time.perf_counter()
            y = fn(x)
            issue.append(time.perf_counter() - t)
            y.block_until_ready()
            total.append(time.perf_counter() - t)
        row["issue_ms_median"] = round(float(np.median(issue)) * 1e3, 3)
        row["call_ms_median"] = round(float(np.median(total)) * 1e3, 3)
        row["issue_us_per_node"] = round(float(np.median(issue)) * 1e6 / n, 2)
        trace_dir = f"/tmp/trace_graph_{kind}_{n}"
        with jax.profiler.trace(trace_dir):
            for _ in range(5):
                fn(x).block_until_ready()
        row.update(host_events(trace_dir, 5))
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
        with open(f"{OUT}/graph_launch.json", "w") as f:
            json.dump(res, f, indent=1)

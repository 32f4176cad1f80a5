"""GPU (2 devices): does an L2 prefetch of the next GEMM's weight, issued beside each all-reduce, pay?

At TP=2 and bs=1 each layer waits ~7 us per all-reduce (NCCL LL, latency-bound) while HBM idles,
then streams the next GEMM's weight. A synthetic Llama-3.1-8B TP=2 layer chain (per GPU: qkv
4096x3072, o_proj 2048x4096, gate_up 4096x14336, down 7168x4096, bf16, ROWS rows) runs as one
jitted shard_map with the engine's tensor-parallel step options, in variants:
- `base`: the chain as the model runs it (psum after o_proj and down);
- `prefetch`: a small Mosaic GPU kernel, started after the row-parallel GEMM, asks the L2 for the
  first PF_MB of the next GEMM's weight (gate_up after o_proj, the next layer's qkv after down),
  tied to the all-reduce's result by an optimization barrier so XLA may run both at once.
Reports the chain's wall time, per-GPU kernel time by name from a trace, and whether the prefetch
kernels overlapped the NCCL kernels in time.

  VARIANT=prefetch PF_MB=24 JAX_PLATFORMS=cuda python notebooks/gpu_tp_prefetch.py
Appends to $OUT/tp_prefetch.json.
"""
import collections
import glob
import gzip
import json
import os
import time

from atlasjax.step_options import step_compiler_options, use_process_flags

use_process_flags(2)

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

OUT = os.environ.get("OUT", "/tmp")
VARIANT = os.environ.get("VARIANT", "base")
ROWS = int(os.environ.get("ROWS", "8"))
LAYERS = int(os.environ.get("LAYERS", "32"))
PF_MB = int(os.environ.get("PF_MB", "24"))
PROGRAMS = int(os.environ.get("PROGRAMS", "16"))
CHUNK = 128 << 10
ITERS = 20
res = {"variant": VARIANT, "rows": ROWS, "layers": LAYERS, "pf_mb": PF_MB, "programs": PROGRAMS,
       "device": jax.devices()[0].device_kind, "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
H, QKV, O_IN, MLP2, MLP = 4096, 3072, 2048, 14336, 7168


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def _bulk_prefetch(ctx, ref):
    del ctx
    ty = ir.MemRefType(ref.type)
    nbytes = ty.shape[0] * mgpu_utils.bitwidth(ty.element_type) // 8
    pred = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.BLOCK)
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [pred, mgpu_utils.memref_ptr(ref)],
                    f"@$0 cp.async.bulk.prefetch.L2.global [$1], {nbytes};", "b,l", has_side_effects=True)


def l2_prefetch(w, after):
    """Ask the L2 for the first PF_MB of w (any shape, row-major); starts once `after` exists."""
    flat = w.reshape(-1)
    chunk = CHUNK // flat.dtype.itemsize
    num_chunks = min(flat.size // chunk, (PF_MB << 20) // CHUNK)

    def kernel(w_ref, after_ref, o_ref):
        del after_ref, o_ref
        p = jax.lax.axis_index("p")
        for j in range(pl.cdiv(num_chunks, PROGRAMS)):
            i = p + j * PROGRAMS

            @pl.when(i < num_chunks)
            def _(i=i):
                _bulk_prefetch(w_ref.at[pl.ds(i * chunk, chunk)])

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((128,), jnp.float32), grid=(PROGRAMS,),
                        grid_names=("p",))(flat, after)


def rms(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype)


def layer_chain(x, wqkv, wo, wgu, wd):
    x = x[0]
    wqkv, wo, wgu, wd = ([w[0] for w in ws] for ws in (wqkv, wo, wgu, wd))   # one array per layer: no slicing copies
    for i in range(LAYERS):
        h = rms(x) @ wqkv[i]
        a = h[:, :O_IN] * 1.01   # stands in for attention
        part = jnp.dot(a, wo[i], preferred_element_type=jnp.float32)
        if VARIANT == "prefetch":
            tok = l2_prefetch(wgu[i], part)
            o, tok = jax.lax.optimization_barrier((jax.lax.psum(part, "model"), tok))
            o = o + tok[:1] * 0.0   # keeps the prefetch (its result is otherwise unused)
        else:
            o = jax.lax.psum(part, "model")
        x = x + o.astype(x.dtype)
        g = rms(x) @ wgu[i]
        m = jax.nn.silu(g[:, :MLP]) * g[:, MLP:]
        part = jnp.dot(m, wd[i], preferred_element_type=jnp.float32)
        if VARIANT == "prefetch" and i + 1 < LAYERS:
            tok = l2_prefetch(wqkv[i + 1], part)
            d, tok = jax.lax.optimization_barrier((jax.lax.psum(part, "model"), tok))
            d = d + tok[:1] * 0.0
        else:
            d = jax.lax.psum(part, "model")
        x = x + d.astype(x.dtype)
    return x[None]


spec = P("model")
fn = jax.jit(jax.shard_map(layer_chain, mesh=mesh, in_specs=(spec, [spec] * LAYERS, [spec] * LAYERS, [spec] * LAYERS,
                                                              [spec] * LAYERS), out_specs=spec, check_vma=False))
shard = NamedSharding(mesh, spec)
keys = jax.random.split(jax.random.key(0), 5)


def rand(k, shape, scale):
    return jax.device_put((jax.random.normal(k, shape, jnp.float32) * scale).astype(jnp.bfloat16), shard)


x = rand(keys[0], (2, ROWS, H), 1.0)
ws = [[rand(jax.random.fold_in(k, i), (2, *shape), shape[0] ** -0.5) for i in range(LAYERS)]
      for k, shape in zip(keys[1:], ((H, QKV), (O_IN, H), (H, MLP2), (MLP, H)))]
if os.environ.get("LOWER_ONLY"):   # a CPU check that the variant lowers for CUDA
    fn.trace(x, *ws).lower(lowering_platforms=("cuda",))
    raise SystemExit("lowered for cuda")
t0 = time.perf_counter()
run = fn.lower(x, *ws).compile(compiler_options=step_compiler_options("gpu", 2))
res["compile_s"] = round(time.perf_counter() - t0, 1)
out = np.asarray(run(x, *ws).astype(jnp.float32))
res["out_checksum"] = float(np.abs(out).sum())
for _ in range(5):
    run(x, *ws).block_until_ready()
times = []
for _ in range(ITERS):
    t = time.perf_counter()
    run(x, *ws).block_until_ready()
    times.append(time.perf_counter() - t)
res["chain_ms_median"] = round(float(np.median(times)) * 1e3, 3)
res["chain_ms_p10"] = round(float(np.percentile(times, 10)) * 1e3, 3)
print(json.dumps(res), flush=True)

trace_dir = f"/tmp/trace_pf_{VARIANT}_{PF_MB}"
N = 3
with jax.profiler.trace(trace_dir):
    for _ in range(N):
        run(x, *ws).block_until_ready()
files = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
with gzip.open(max(files)) as f:
    trace = json.load(f)
events = trace["traceEvents"] if isinstance(trace, dict) else trace
names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
by = collections.Counter()
count = collections.Counter()
per_dev = collections.defaultdict(list)
for e in events:
    if e.get("ph") == "X" and "dur" in e:
        proc = names.get(e["pid"], "").lower()
        if "gpu" in proc or "/device" in proc:
            by[e["name"][:60]] += e["dur"]
            count[e["name"][:60]] += 1
            per_dev[proc[:30]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
res["kernels_us_per_chain_per_gpu"] = [(n, count[n] / N / 2, round(d / N / 2, 1)) for n, d in by.most_common(14)]
overlap = {}
for dev, evs in per_dev.items():
    nccl = [(s, t) for s, t, n in evs if "nccl" in n.lower()]
    pf = [(s, t) for s, t, n in evs if "kernel" in n.lower() and "nccl" not in n.lower() and "gemm" not in n.lower()]
    ov = sum(max(0.0, min(t, t2) - max(s, s2)) for s, t in pf for s2, t2 in nccl)
    evs.sort()
    busy, end = 0.0, None
    for s, t, _ in evs:
        if end is None or s >= end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    overlap[dev] = {"prefetch_us": round(sum(t - s for s, t in pf) / N, 1), "nccl_us": round(sum(t - s for s, t in nccl) / N, 1),
                    "overlap_us": round(ov / N, 1), "busy_us": round(busy / N, 1),
                    "span_us": round((max(t for _, t, _ in evs) - min(s for s, _, _ in evs)) / N, 1)}
res["overlap_per_chain"] = overlap
print(json.dumps(res), flush=True)
with open(f"{OUT}/tp_prefetch.json", "a") as f:
    f.write(json.dumps(res) + "\n")

"""GPU (2 devices): a one-shot all-reduce written in Mosaic GPU (peer memory, below) against XLA's.

A chain of LAYERS all-reduces of f32 [rows, 4096] partials (each fed by an elementwise op, as a
row-parallel projection's output would be) runs as one jitted shard_map per variant:
- `nccl`: lax.psum with the engine's tensor-parallel step options (NCCL inside the CUDA graph);
- `xla_default`: lax.psum with XLA's defaults (its one-shot all-reduce kernel, outside the graph);
- `mosaic`: one_shot_all_reduce, Mosaic GPU's cross-device barrier before each launch;
- `mosaic_nobarrier`: the same without that barrier (did not finish in 120 s on 2x H200, session
  17: without it a peer can signal before the semaphores are zeroed; run it with a timeout);
- `none`: the chain without all-reduces (the floor of the elementwise ops and launches).
Reports: equality with psum, wall time per chain (median of ITERS), and from a profiler trace the
GPU time per all-reduce, the kernels by name and the host events (graph launches) per chain.

  VARIANT=mosaic ROWS=8 JAX_PLATFORMS=cuda python notebooks/gpu_all_reduce.py
Appends to $OUT/all_reduce.json.
"""
import collections
import glob
import gzip
import json
import os
import time

from atlasjax.step_options import step_compiler_options, use_process_flags

use_process_flags(2)   # as the engine does, before jax starts

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# The kernel (kept here as the record: measured slower than NCCL, not used by the engine).
# Each block of the grid owns a band of rows and:
# 1. tells every peer's same block that it has entered this call (so the peer's landing buffer is
#    live), and waits for all of them to say the same;
# 2. writes its band of x into slot `me` of every peer's landing buffer (and of its own) through
#    NVLink, then signals each peer;
# 3. waits for every peer's band and sums the slots in device order 0..N-1, so every device
#    computes the same bits (for two devices a + b == b + a anyway).
# The landing buffer is a second output, so XLA allocates it where peers can reach it. The
# semaphores are the kernel's scratch, zeroed before each call; Mosaic GPU's cross-device barrier
# before the launch keeps a peer from signalling before they are zeroed.


def one_shot_all_reduce(x: jax.Array, axis_name: str, *, rows_per_block: int = 1,
                        skip_device_barrier: bool = False, out_dtype=None) -> jax.Array:
    """Sum x [rows, width] over `axis_name` (call inside shard_map on GPUs)."""
    rows, width = x.shape
    if rows % rows_per_block:
        raise ValueError(f"rows ({rows}) must be a multiple of rows_per_block ({rows_per_block})")
    num_devices = lax.axis_size(axis_name)
    out_dtype = out_dtype or x.dtype

    def kernel(x_ref, out_ref, landing_ref, entered, arrived):
        me = lax.axis_index(axis_name)
        band = pl.ds(lax.axis_index("blocks") * rows_per_block, rows_per_block)
        peers = [lax.rem(me + k, num_devices) for k in range(1, num_devices)]
        for peer in peers:
            pl.semaphore_signal(entered, device_id={axis_name: peer})
        pl.semaphore_wait(entered, num_devices - 1)
        part = x_ref[band, :]
        landing_ref[me, band, :] = part
        for peer in peers:
            plgpu.remote_ref(landing_ref, {axis_name: peer})[me, band, :] = part
            pl.semaphore_signal(arrived, device_id={axis_name: peer})
        pl.semaphore_wait(arrived, num_devices - 1)
        total = landing_ref[0, band, :].astype(jnp.float32)
        for j in range(1, num_devices):
            total = total + landing_ref[j, band, :].astype(jnp.float32)
        out_ref[band, :] = total.astype(out_ref.dtype)

    out, _ = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((rows, width), out_dtype),
                   jax.ShapeDtypeStruct((num_devices, rows, width), x.dtype)),
        grid=(rows // rows_per_block,),
        grid_names=("blocks",),
        scratch_types=[plgpu.SemaphoreType.REGULAR, plgpu.SemaphoreType.REGULAR],
        compiler_params=plgpu.CompilerParams(skip_device_barrier=skip_device_barrier),
    )(x)
    return out


OUT = os.environ.get("OUT", "/tmp")
VARIANT = os.environ.get("VARIANT", "mosaic")
ROWS = int(os.environ.get("ROWS", "8"))
WIDTH = int(os.environ.get("WIDTH", "4096"))
LAYERS = int(os.environ.get("LAYERS", "64"))
RPB = int(os.environ.get("RPB", "1"))   # rows per block of the Mosaic kernel
ITERS = 30
res = {"variant": VARIANT, "rows": ROWS, "rows_per_block": RPB, "width": WIDTH, "layers": LAYERS,
       "device": jax.devices()[0].device_kind, "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}

mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))


def reduce_fn(variant):
    if variant in ("nccl", "xla_default"):
        return lambda y: jax.lax.psum(y, "model")
    if variant == "mosaic":
        return lambda y: one_shot_all_reduce(y, "model", rows_per_block=RPB)
    if variant == "mosaic_nobarrier":
        return lambda y: one_shot_all_reduce(y, "model", rows_per_block=RPB, skip_device_barrier=True)
    return lambda y: y * 2.0


def chain(variant, layers):
    reduce = reduce_fn(variant)

    def body(x, b):
        y = x[0]
        for i in range(layers):
            y = reduce(y * 0.5 + b[0, i])
        return y[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("model"), P("model")), out_specs=P("model"),
                                 check_vma=False))


def compile_chain(variant, layers, x, b):
    opts = {} if variant == "xla_default" else step_compiler_options("gpu", 2)
    return chain(variant, layers).lower(x, b).compile(compiler_options=opts)


def log():
    print(json.dumps(res), flush=True)


shard = NamedSharding(mesh, P("model"))
x = jax.device_put(jax.random.normal(jax.random.key(0), (2, ROWS, WIDTH), jnp.float32), shard)
b = jax.device_put(jax.random.normal(jax.random.key(1), (2, LAYERS, WIDTH), jnp.float32) * 0.01, shard)

# Equality with psum on one all-reduce
one = compile_chain(VARIANT, 1, x, b)
ref = compile_chain("nccl", 1, x, b)
got, want = np.asarray(one(x, b)), np.asarray(ref(x, b))
res["one_call_max_abs_diff_vs_psum"] = float(np.max(np.abs(got - want))) if VARIANT != "none" else None
res["devices_agree"] = bool(np.array_equal(got[0], got[1]))
log()

t0 = time.perf_counter()
run = compile_chain(VARIANT, LAYERS, x, b)
res["compile_s"] = round(time.perf_counter() - t0, 2)
hlo = run.as_text()
res["hlo_command_buffer_computations"] = hlo.count("command_buffer")
res["hlo_mosaic_calls"] = hlo.count("mosaic_gpu")
full = np.asarray(run(x, b))
if VARIANT != "none":
    res["chain_max_abs_diff_vs_psum"] = float(np.max(np.abs(full - np.asarray(compile_chain("nccl", LAYERS, x, b)(x, b)))))
for _ in range(5):
    run(x, b).block_until_ready()
times = []
for _ in range(ITERS):
    t = time.perf_counter()
    run(x, b).block_until_ready()
    times.append(time.perf_counter() - t)
res["chain_ms_median"] = round(float(np.median(times)) * 1e3, 4)
res["chain_ms_p10"] = round(float(np.percentile(times, 10)) * 1e3, 4)
res["per_reduce_us_wall"] = round(float(np.median(times)) * 1e6 / LAYERS, 2)
log()

trace_dir = f"/tmp/trace_ar_{VARIANT}_{ROWS}"
N = 5
with jax.profiler.trace(trace_dir):
    for _ in range(N):
        run(x, b).block_until_ready()
files = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
with gzip.open(max(files)) as f:
    trace = json.load(f)
events = trace["traceEvents"] if isinstance(trace, dict) else trace
names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
gpu = collections.Counter()
gpu_n = collections.Counter()
host = collections.Counter()
host_n = collections.Counter()
per_device = collections.Counter()
for e in events:
    if e.get("ph") != "X" or "dur" not in e:
        continue
    proc = names.get(e["pid"], "").lower()
    if "gpu" in proc or "/device" in proc:
        gpu[e["name"][:70]] += e["dur"]
        gpu_n[e["name"][:70]] += 1
        per_device[proc[:40]] += e["dur"]
    elif "host" in proc:
        host[e["name"][:60]] += e["dur"]
        host_n[e["name"][:60]] += 1
res["gpu_us_per_chain_by_device"] = {k: round(v / N, 1) for k, v in per_device.items()}
res["kernels_per_chain"] = [(n, gpu_n[n] / N, round(d / N, 1)) for n, d in gpu.most_common(12)]
res["host_events_per_chain"] = [(n, host_n[n] / N, round(d / N, 1)) for n, d in host.most_common(12)]
log()
with open(f"{OUT}/all_reduce.json", "a") as f:
    f.write(json.dumps(res) + "\n")

"""GPU: what the host spends to issue one decode step, and whether fresh buffer addresses cost it.

Each call of the compiled decode step is timed from the call until it returns (the host's work:
argument handling, XLA's command-buffer update and cuGraphLaunch), then waited on, so no queue
back-pressure is measured. Cases:
  same        the same device input array every call, outputs dropped before the next call
  fresh_in    a new device input array (device_put) every call, as the engine does
  outs_alive  same inputs, but every output kept alive (each call gets new output addresses)
  runner      `runner.decode` with numpy inputs (the engine's path), waited on after each call

  JAX_PLATFORMS=cuda QUANT=int4 python notebooks/gpu_host_dispatch.py   (writes $OUT/host_dispatch_*.json)
"""
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.steps import pack_host
from atlasjax.sampling import pack_rows
from atlasjax.sampling_params import SamplingParams

OUT = os.environ.get("OUT", "/tmp")
QUANT = os.environ.get("QUANT") or None
PRESET = os.environ.get("PRESET", "llama-3.1-8b")
N = 30

engine = LLMEngine(EngineConfig(num_scheduler_steps=1, dtype="bfloat16", max_num_seqs=8, max_model_len=1024,
                                page_size=16, num_pages=136, max_num_batched_tokens=512),
                   load_preset(PRESET, jnp.bfloat16, QUANT, 0, 1))
engine.add_request("r0", list(range(1, 129)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
for _ in range(12):
    engine.step()

r, s = engine.runner, engine.num_slots
key = next(k for k in r._compiled if k[0] == "decode" and k[1] == s and k[2].greedy and not k[2].logprobs)
step_fn = r._compiled[key]
pt = np.zeros((s, r.pages_per_seq), np.int32)
pt[:, :9] = np.arange(9 * s).reshape(s, 9)
lens = np.zeros(s, np.int32)
lens[0] = 140
f, i = pack_rows([(SamplingParams(temperature=0), 0, 0, ())], s)
host_packed = pack_host((np.ones(s, np.int32), pt, lens, np.arange(s, dtype=np.int32), f, i))[0]
packed = jnp.asarray(host_packed)
z = jnp.zeros((s,), jnp.int32)


def timed(make_args, keep=None):
    times = []
    for _ in range(N + 3):
        args = make_args()
        jax.block_until_ready(args)
        t = time.perf_counter()
        r.state, out = step_fn(r.params, r.state, *args)
        times.append(time.perf_counter() - t)
        jax.block_until_ready(out)
        if keep is not None:
            keep.append(out)
    return {"median_ms": 1e3 * statistics.median(times[3:]), "min_ms": 1e3 * min(times[3:])}


res = {"device": jax.devices()[0].device_kind, "quant": QUANT, "preset": PRESET}
res["same"] = timed(lambda: (packed, z, z))
res["fresh_in"] = timed(lambda: (jnp.asarray(host_packed.copy()), z, z))
res["outs_alive"] = timed(lambda: (packed, z, z), keep=[])
times = []
for _ in range(N + 3):
    t = time.perf_counter()
    out = r.decode(np.ones(s, np.int32), pt, lens, f, i, plan=key[2])
    times.append(time.perf_counter() - t)
    jax.block_until_ready(out.tokens)
res["runner"] = {"median_ms": 1e3 * statistics.median(times[3:]), "min_ms": 1e3 * min(times[3:])}
print(json.dumps(res, indent=1))
with open(f"{OUT}/host_dispatch_{QUANT or 'bf16'}.json", "w") as fh:
    json.dump(res, fh, indent=1)

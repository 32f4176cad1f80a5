"""What admitting N requests in one step costs: N one-request admit programs (how the engine admitted
before session 61) against the batched admit (one program per 16 requests).

Times `runner.admit` on an engine's device state (vocabulary-sized penalty rows, as the preset has them):
the host time until the call returns (dispatch; nothing waits for the device) and the time until the
state is ready, median of REPS. Works on CPU and GPU.

  [PRESET=llama-3.2-1b] [SLOTS=64] [N=16] [PROMPT=128] python notebooks/admit_batching.py
Prints one JSON line.
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig

PRESET = os.environ.get("PRESET", "llama-3.2-1b")
SLOTS, N, PROMPT, REPS = (int(os.environ.get(k, d)) for k, d in (("SLOTS", 64), ("N", 16), ("PROMPT", 128),
                                                                  ("REPS", 20)))
engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=SLOTS, max_model_len=4096, page_size=16, num_pages=260,
                                max_num_batched_tokens=512), load_preset(PRESET, jnp.bfloat16))
runner = engine.runner
rng = np.random.default_rng(0)
requests = [(slot, rng.integers(0, engine.model_config.vocab_size, PROMPT).tolist(), PROMPT, None, [])
            for slot in range(N)]


def timed(admit):
    admit()
    jax.block_until_ready(runner.state.counts)   # compiled and warm
    dispatch, ready = [], []
    for _ in range(REPS):
        t0 = time.perf_counter()
        admit()
        t1 = time.perf_counter()
        jax.block_until_ready(runner.state.counts)
        dispatch.append(t1 - t0)
        ready.append(time.perf_counter() - t0)
    return {"dispatch_ms": round(1e3 * float(np.median(dispatch)), 3), "ready_ms": round(1e3 * float(np.median(ready)), 3)}


one_at_a_time = timed(lambda: [runner.admit([r]) for r in requests])
batched = timed(lambda: runner.admit(requests))
print(json.dumps({"device": str(jax.devices()[0]), "preset": PRESET, "vocab": engine.model_config.vocab_size,
                  "slots": SLOTS, "requests": N, "prompt_tokens": PROMPT, "one_at_a_time": one_at_a_time,
                  "batched": batched}))

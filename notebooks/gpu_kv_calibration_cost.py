"""GPU: what `--calculate-kv-scales` adds to a start (session 51): the reference prefill of the
calibration text and the folds, on Llama-3.1-8B shapes (random weights), timed twice in one process
(the first call compiles).

  JAX_PLATFORMS=cuda PYTHONPATH=. [QUANT=int4] python notebooks/gpu_kv_calibration_cost.py
"""
import json
import os
import time

import jax
import jax.numpy as jnp

from atlasjax.bench.presets import load_preset
from atlasjax.kv_calibration import calculate_kv_scales

quant = os.environ.get("QUANT") or None
loaded = load_preset("llama-3.1-8b", jnp.bfloat16, quantization=quant)
times = []
for _ in range(2):
    t = time.perf_counter()
    out = calculate_kv_scales(loaded.config, loaded.params, loaded.tokenizer, jnp.bfloat16, jnp.float8_e4m3fn, 8192)
    jax.block_until_ready(out)
    times.append(round(time.perf_counter() - t, 2))
print(json.dumps(dict(device=jax.devices()[0].device_kind, quantization=quant, seconds=times)))

"""GPU: what smoothing adds to an int8 W8A8 start (session 51): the calibration prefill that measures
the projections' inputs, the migration into the weights and the int8 quantization of the smoothed
tree, on Llama-3.1-8B shapes (random bf16 weights), against quantizing alone.

  JAX_PLATFORMS=cuda PYTHONPATH=. python notebooks/gpu_smoothing_cost.py
"""
import json
import time

import jax
import jax.numpy as jnp

from atlasjax.bench.presets import load_preset
from atlasjax.quantization import quantize_params
from atlasjax.smoothing import smooth_for_int8_activations


def timed(fn):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return round(time.perf_counter() - t, 2)


loaded = load_preset("llama-3.1-8b", jnp.bfloat16)
cfg, params = loaded.config, loaded.params
quantize_only = timed(lambda: quantize_params(params, "int8"))
smoothed = {}
smoothing = timed(lambda: smoothed.setdefault("p", smooth_for_int8_activations(cfg, params, loaded.tokenizer,
                                                                                jnp.bfloat16, 8192)))
quantize_smoothed = timed(lambda: quantize_params(smoothed["p"], "int8"))
print(json.dumps(dict(device=jax.devices()[0].device_kind, quantize_s=quantize_only, smoothing_s=smoothing,
                      quantize_after_smoothing_s=quantize_smoothed)))

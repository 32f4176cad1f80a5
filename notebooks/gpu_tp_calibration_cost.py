"""GPU: what the calibrations cost a tensor-parallel start (session 52): `--calculate-kv-scales` and
the smoothing before int8 W8A8 on Llama-3.1-8B shapes (random bf16 weights) at TP (default 2). Each
runs on one device's tree: the shards gathered onto the first device, the calibration there, the
result placed on the mesh again (atlasjax/model_source.py `_on_one_device`; since session 53 both moves
go device to device, before through the host). Timed twice in one process (the first call compiles),
with the gather and the placement timed alone, both ways (through the host, and device to device).

  JAX_PLATFORMS=cuda PYTHONPATH=. [TP=2] python notebooks/gpu_tp_calibration_cost.py
"""
import json
import os
import time

import jax
import jax.numpy as jnp

from atlasjax.bench.presets import load_preset
from atlasjax.engine_config import EngineConfig
from atlasjax.kv_calibration import calculate_kv_scales
from atlasjax.model_source import _calibrated, _on_one_device, shard_loaded
from atlasjax.sharding import logical_axes

TP = int(os.environ.get("TP", "2"))
DTYPE = jnp.bfloat16
loaded = shard_loaded(load_preset(os.environ.get("PRESET", "llama-3.1-8b"), DTYPE), TP, DTYPE)
cfg, plan, params = loaded.config, loaded.plan, loaded.params
res = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "tp": TP}


def timed(fn):
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, round(time.perf_counter() - t, 2)


logical, first = logical_axes(cfg, DTYPE), jax.devices()[0]
host, res["gather_to_host_s"] = timed(lambda: plan.gather(params, logical))
_, res["host_to_first_device_s"] = timed(lambda: jax.device_put(host, first))
_, res["place_from_host_s"] = timed(lambda: plan.shard_params(host, logical))
host = None   # freed before the device-to-device moves
for i in range(2):   # the first call compiles the slices
    one, res[f"gather_to_first_device_s_{i}"] = timed(lambda: plan.gather(params, logical, device=first))
    _, res[f"place_from_first_device_s_{i}"] = timed(lambda: plan.shard_params(one, logical))
    one = None
print(json.dumps(res), flush=True)

kv = lambda p: calculate_kv_scales(cfg, p, loaded.tokenizer, DTYPE, jnp.float8_e4m3fn, 8192)  # noqa: E731
res["kv_scales_s"] = [timed(lambda: _on_one_device(plan, cfg, DTYPE, params, kv))[1] for _ in range(2)]
print(json.dumps(res), flush=True)
config = EngineConfig(quantization="int8", activation_quantization="int8", tensor_parallel_size=TP)
smooth = lambda p: _calibrated(p, config, cfg, loaded.tokenizer, DTYPE, DTYPE, 8192, True)  # noqa: E731
res["smooth_and_int8_s"] = [timed(lambda: _on_one_device(plan, cfg, DTYPE, params, smooth))[1] for _ in range(2)]
print(json.dumps(res), flush=True)

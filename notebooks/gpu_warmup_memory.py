"""Device memory around a server's start: the weight build, the KV pool, the warm-up compiles.

    JAX_PLATFORMS=cuda PRESET=llama-3.1-8b QUANT=int4 SLOTS=64 [UTIL=0.85 | PAGES=N] THREADS=1 \
        python notebooks/gpu_warmup_memory.py

Builds the engine as `python -m atlasjax serve` does (preset weights, the KV pool from free memory
unless PAGES is given), then runs `runner.warmup` and prints the allocator's statistics (GiB) after
each phase, the pool's size and each phase's time. Writes `$OUT/warmup_memory_<TAG>.json`.
"""
import json
import os
import time

import logging

import jax

import atlasjax.model_source
from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

KEYS = ("bytes_limit", "bytes_in_use", "peak_bytes_in_use", "largest_free_block_bytes", "largest_alloc_size",
        "bytes_reserved", "pool_bytes")
report = {"env": {k: os.environ.get(k) for k in ("PRESET", "QUANT", "SLOTS", "UTIL", "PAGES", "THREADS",
                                                 "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")}}


def phase(name, t0):
    stats = jax.local_devices()[0].memory_stats() or {}
    report[name] = {k: round(stats[k] / 2**30, 3) for k in KEYS if k in stats}
    report[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(name, report[name], flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, f"warmup_memory_{os.environ.get('TAG', 'run')}.json"), "w") as f:
        json.dump(report, f, indent=1)


t = time.perf_counter()
phase("start", t)
quant = os.environ.get("QUANT") or None


def load_for_engine(config, dtype):   # as atlasjax.bench.preset_server: the engine owns what it loads
    loaded = load_preset(os.environ.get("PRESET", "llama-3.1-8b"), dtype, quant, 0)
    phase("weights", t)
    return loaded


atlasjax.model_source.load_for_engine = load_for_engine
kw = dict(max_num_seqs=int(os.environ.get("SLOTS", "64")), quantization=quant,
          gpu_memory_utilization=float(os.environ.get("UTIL", "0.85")))
if os.environ.get("PAGES"):
    kw["num_pages"] = int(os.environ["PAGES"])
engine = LLMEngine(EngineConfig(**kw))
jax.block_until_ready(engine.runner.state)
report["num_pages"] = engine.pool.num_pages
report["kv_pool_gib"] = round(sum(x.nbytes for x in jax.tree.leaves(engine.runner.state.kv)) / 2**30, 3)
phase("engine", t)   # since the start (weights included)
t = time.perf_counter()
try:
    engine.runner.warmup(threads=int(os.environ.get("THREADS", "1")))
    report["warmup_error"] = None
except Exception as e:   # noqa: BLE001 - what failed is the result
    report["warmup_error"] = str(e)[:300]
report["compiles"] = engine.runner.num_compiles
phase("warmup", t)

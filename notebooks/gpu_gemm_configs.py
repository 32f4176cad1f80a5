"""GPU: the GEMM tiles XLA compiled into the engine's decode executables, one step per launch and
several (a `lax.scan` body), side by side.

XLA autotunes each GEMM fusion as it compiles it, and what it fuses into the GEMM (an RMSNorm's scale,
say) changes what it picks: session 28 found the one-step executable's fp8 gate_up on a 128-column
TMA tile (45.8 us on an H100) where the multi-step body had a 64-column one (42.2 us).

  JAX_PLATFORMS=cuda QUANT=fp8 [LM_HEAD=1] [PRESET=llama-3.1-8b] python notebooks/gpu_gemm_configs.py
Prints one line per distinct GEMM fusion: the executable, its operand shapes, the tile and pipeline
config, and how many layers use it; writes $OUT/gemm_configs_<quant>.json.
"""
import collections
import json
import os
import re

import jax.numpy as jnp

from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.sampling_params import SamplingParams

OUT = os.environ.get("OUT", "/tmp")
QUANT = os.environ.get("QUANT") or None
PRESET = os.environ.get("PRESET", "llama-3.1-8b")
LM_HEAD = os.environ.get("LM_HEAD") == "1"
FUSION = re.compile(r'%gemm_fusion\S* = .*?calls=%([^,\s]+).*?"block_level_fusion_config":(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})')
COMPUTATION = re.compile(r"^%(\S+) \((.*)\) -> (\S+) \{$")


def gemm_fusions(hlo: str):
    """(parameter shapes -> output, config) of every Triton GEMM fusion in an optimized HLO module."""
    signatures = {m.group(1): (re.findall(r"\w+\[[\d,]*\]", m.group(2)), m.group(3))
                  for m in map(COMPUTATION.match, hlo.splitlines()) if m}
    for m in FUSION.finditer(hlo):
        params, out = signatures.get(m.group(1), ([], "?"))
        cfg = json.loads(m.group(2))
        yield " ".join(params) + " -> " + out, {k: cfg.get(k) for k in ("output_tiles", "num_stages", "num_warps",
                                                                         "is_tma_allowed", "num_ctas")}


results = {}
for steps in (1, 4):
    engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=8, max_model_len=1024, page_size=16, num_pages=136,
                                    max_num_batched_tokens=512, num_scheduler_steps=steps),
                       load_preset(PRESET, jnp.bfloat16, QUANT, 0, 1, quantize_lm_head=LM_HEAD))
    engine.add_request("r0", list(range(1, 129)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(12):
        engine.step()
    for key, compiled in engine.runner._compiled.items():
        if key[0] != "decode":
            continue
        name = f"decode, {key[3] if len(key) > 3 else 1} step(s) per launch"
        counts = collections.Counter(json.dumps(x) for x in gemm_fusions(compiled.as_text()))
        results[name] = [{"fusion": json.loads(x)[0], "config": json.loads(x)[1], "count": n}
                         for x, n in counts.most_common()]
        for row in results[name]:
            print(f"{name} | {row['fusion']} | {row['config']} | x{row['count']}", flush=True)
    del engine
with open(f"{OUT}/gemm_configs_{QUANT or 'bf16'}.json", "w") as f:
    json.dump(results, f, indent=1)

"""GPU: how XLA fuses a decode layer's residual add and the RMSNorm after it.

On an H200 (session 52) a fp8 8B decode layer ran them as two kernels each time (`loop_add_fusion`
then a norm `fusion_NNN`, ~1.7 us each, twice per layer). This prints, for the engine's multi-step
decode executable, every fusion whose computation takes an rsqrt (the norms) and every fusion feeding
one: its kind and the start of its backend config, so that XLA_FLAGS variants can be compared.

  JAX_PLATFORMS=cuda QUANT=fp8 [XLA_FLAGS=...] python notebooks/gpu_norm_fusion_probe.py
Writes $OUT/decode_hlo_<quant><TAG>.txt (the optimized HLO of the multi-step decode executable).
"""
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
TAG = os.environ.get("TAG", "")

engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=8, max_model_len=1024, page_size=16, num_pages=136,
                                max_num_batched_tokens=512, num_scheduler_steps=4),
                   load_preset(PRESET, jnp.bfloat16, QUANT, 0, 1))
engine.add_request("r0", list(range(1, 129)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
for _ in range(12):
    engine.step()
hlo = next(c.as_text() for k, c in engine.runner._compiled.items() if k[0] == "decode" and len(k) > 3 and k[3] > 1)
with open(f"{OUT}/decode_hlo_{QUANT or 'bf16'}{TAG}.txt", "w") as f:
    f.write(hlo)

# computation name -> body lines
bodies, name = {}, None
for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if m:
        name, bodies[m.group(1)] = m.group(1), []
    elif name is not None:
        bodies[name].append(line)
norm_comps = {c for c, body in bodies.items() if any(" rsqrt(" in b for b in body)}
fusion = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) fusion\((.*?)\), kind=(\w+), calls=%([^,\s]+)(.*)$")
producers = {}
OPCODE = re.compile(r"= \S+ (\w+)\(")
for line in hlo.splitlines():
    m = fusion.match(line)
    if m:
        producers[m.group(1)] = (m.group(4), m.group(5), m.group(2))
seen = set()
for line in hlo.splitlines():
    m = fusion.match(line)
    if not m or m.group(5) not in norm_comps or m.group(5) in seen:
        continue
    seen.add(m.group(5))
    operands = re.findall(r"%([\w.\-]+)", m.group(3))
    print(f"NORM {m.group(1)} kind={m.group(4)} out={m.group(2)[:80]} config={m.group(6)[:160]}")
    for op in operands:
        if op in producers:
            kind, comp, shape = producers[op]
            ops = sorted(set(OPCODE.findall("\n".join(bodies.get(comp, [])))))
            print(f"   <- {op} kind={kind} out={shape[:80]} ops={ops}")
print("fusion kinds:", {k: sum(1 for v in producers.values() if v[0] == k) for k in {v[0] for v in producers.values()}})

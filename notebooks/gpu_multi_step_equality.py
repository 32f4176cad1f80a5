"""GPU: greedy decoding with one step per launch against `num_scheduler_steps` K, token by token.

Random-weight preset (default llama-3.2-1b), 4 prompts of 100-190 random tokens, 48 greedy tokens
each, top-2 logprobs. Per request: how many tokens agree before the first difference, the largest
logprob difference over the tokens that agree, and at a difference the top-2 gap of the one-step
run (a near-tie flips on any change of rounding).

  JAX_PLATFORMS=cuda [PRESET=llama-3.2-1b] [QUANT=int8] [STEPS=4] [ATTN=reference] python notebooks/gpu_multi_step_equality.py
"""
import gc
import json
import os

import jax.numpy as jnp
import numpy as np

from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.sampling_params import SamplingParams

PRESET = os.environ.get("PRESET", "llama-3.2-1b")
QUANT = os.environ.get("QUANT") or None
STEPS = int(os.environ.get("STEPS", "4"))
ATTN = os.environ.get("ATTN", "auto")   # attention_backend: auto (the Pallas kernels on a GPU) | reference


def run(steps):
    engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=8, max_model_len=1024, page_size=16,
                                    num_pages=200, max_num_batched_tokens=512, num_scheduler_steps=steps,
                                    attention_backend=ATTN),
                       load_preset(PRESET, jnp.bfloat16, QUANT, 0, 1))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    for i in range(4):
        engine.add_request(f"r{i}", rng.integers(0, engine.model_config.vocab_size, 100 + 30 * i).tolist(), params)
    while engine.has_unfinished():
        engine.step()
    out = []
    for i in range(4):
        req = engine.requests[f"r{i}"][0]
        chosen = [d[t].logprob for d, t in zip(req.logprobs, req.output_token_ids)]
        top2 = [sorted((v.logprob for v in d.values()), reverse=True)[:2] for d in req.logprobs]
        out.append((req.output_token_ids, chosen, top2))
    del engine
    gc.collect()
    return out


one, multi = run(1), run(STEPS)
report = {"preset": PRESET, "quant": QUANT, "steps": STEPS, "attention": ATTN, "requests": []}
for (t1, lp1, top1), (tk, lpk, _) in zip(one, multi):
    agree = next((j for j, (a, b) in enumerate(zip(t1, tk)) if a != b), len(t1))
    diff = max((abs(a - b) for a, b in zip(lp1[:agree], lpk[:agree])), default=0.0)
    gap = top1[agree][0] - top1[agree][1] if agree < len(t1) and len(top1[agree]) > 1 else None
    report["requests"].append({"tokens_agreeing": agree, "of": len(t1), "max_logprob_diff": round(diff, 4),
                               "top2_gap_at_difference": None if gap is None else round(gap, 4)})
print(json.dumps(report))

"""GPU: the long-context decode program (atlasjax/long_context_decode.py) against the default program,
token by token, with the Pallas decode kernel.

Random-weight preset (default llama-3.2-1b: 8 KV heads, as the 8B), bf16, one and then two requests
of 3,000-3,100 random prompt tokens (past MIN_CONTEXT, so every decode step of the `on` engine runs
the long-context program), 48 greedy tokens each, top-2 logprobs. Per request: tokens agreeing before
the first difference, the largest logprob difference over them, and at a difference the default
run's top-2 gap (a near-tie flips on any change of summation order: more splits merge differently);
each kernel program also against XLA's attention (attention_backend="reference").

  JAX_PLATFORMS=cuda [PRESET=llama-3.2-1b] python notebooks/gpu_long_context_equality.py
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


def run(long_context, num_requests, attention="auto"):
    engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=8, max_model_len=3200, page_size=16,
                                    num_pages=1700, max_num_batched_tokens=512, long_context_decode=long_context,
                                    attention_backend=attention),
                       load_preset(PRESET, jnp.bfloat16, None, 0, 1))
    assert engine.runner.long_context_decode == long_context
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    for i in range(num_requests):
        engine.add_request(f"r{i}", rng.integers(0, engine.model_config.vocab_size, 3000 + 100 * i).tolist(), params)
    while engine.has_unfinished():
        engine.step()
    ran_long = any(k[0] == "decode_long_context" for k in engine.runner._compiled)
    out = []
    for i in range(num_requests):
        req = engine.requests[f"r{i}"][0]
        chosen = [d[t].logprob for d, t in zip(req.logprobs, req.output_token_ids)]
        top2 = [sorted((v.logprob for v in d.values()), reverse=True)[:2] for d in req.logprobs]
        out.append((req.output_token_ids, chosen, top2))
    del engine
    gc.collect()
    return out, ran_long


def compare(base, other):
    (t1, lp1, top1), (tk, lpk, _) = base, other
    agree = next((j for j, (a, b) in enumerate(zip(t1, tk)) if a != b), len(t1))
    diff = max((abs(a - b) for a, b in zip(lp1[:agree], lpk[:agree])), default=0.0)
    gap = top1[agree][0] - top1[agree][1] if agree < len(t1) and len(top1[agree]) > 1 else None
    return {"tokens_agreeing": agree, "of": len(t1), "max_logprob_diff": round(diff, 4),
            "top2_gap_at_difference": None if gap is None else round(gap, 4)}


# Each kernel program against the other and against XLA's attention (the jnp reference, f32 softmax).
report = {"preset": PRESET, "runs": []}
for n in (1, 2):
    (default, _), (long_context, ran_long), (reference, _) = run(False, n), run(True, n), run(False, n, "reference")
    for i in range(n):
        report["runs"].append({"requests": n, "request": i, "long_context_program_ran": ran_long,
                               "long_vs_default": compare(default[i], long_context[i]),
                               "default_vs_reference": compare(reference[i], default[i]),
                               "long_vs_reference": compare(reference[i], long_context[i])})
print(json.dumps(report))

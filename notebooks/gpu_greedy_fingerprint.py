"""GPU: a fingerprint of greedy decoding, to check that a change (a kernel, an XLA flag) alters no numerics.

Random-weight preset (default llama-3.2-1b), 4 prompts of 100-190 random tokens, 48 greedy tokens each
with their logprobs; prints the md5 of tokens + logprobs, the first tokens and the logprob sum. Two runs
print the same md5 only if every token and every logprob (to 3 decimals) agree. `fingerprint` takes the
logprobs in the order the engine streamed them (comparable with earlier sessions' figures);
`per_request` takes them request by request, so it also compares runs with different STEPS
(`num_scheduler_steps`: multi-step decodes stream several tokens per delta).

  JAX_PLATFORMS=cuda [PRESET=llama-3.2-1b] [QUANT=int8] [TP=2] [STEPS=4] [CACHE=dir] python notebooks/gpu_greedy_fingerprint.py

CACHE: jax's compilation cache (and the program store inside it) in that directory; the last line then
says how many step programs were compiled and how many loaded from the store.
"""
import hashlib
import json
import os

import jax.numpy as jnp
import numpy as np

from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.sampling_params import SamplingParams

from atlasjax import compile_cache

compile_cache.enable(os.environ.get("CACHE") or None)
PRESET = os.environ.get("PRESET", "llama-3.2-1b")
QUANT = os.environ.get("QUANT") or None
TP = int(os.environ.get("TP", "1"))
STEPS = int(os.environ.get("STEPS", "1"))

engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=8, max_model_len=1024, page_size=16, num_pages=200,
                                max_num_batched_tokens=512, tensor_parallel_size=TP,
                                num_scheduler_steps=STEPS),
                   load_preset(PRESET, jnp.bfloat16, QUANT, 0, TP))
rng = np.random.default_rng(0)
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
for i in range(4):
    engine.add_request(f"r{i}", rng.integers(0, engine.model_config.vocab_size, 100 + 30 * i).tolist(), params)
tokens = {f"r{i}": [] for i in range(4)}
by_request = {f"r{i}": [] for i in range(4)}
logprobs = []
while engine.has_unfinished():
    for d in engine.step():
        tokens[d.request_id] += d.new_token_ids
        lps = [round(next(iter(x.values())).logprob, 3) for x in (d.new_logprobs or [])]
        logprobs.extend(lps)
        by_request[d.request_id] += lps
tokens = [tokens[f"r{i}"] for i in range(4)]
digest = hashlib.md5(json.dumps([tokens, logprobs]).encode()).hexdigest()
per_request = hashlib.md5(json.dumps([tokens, [by_request[f"r{i}"] for i in range(4)]]).encode()).hexdigest()
print("fingerprint", os.environ.get("XLA_FLAGS", ""), digest, "per_request", per_request, "steps", STEPS,
      "first tokens", tokens[0][:12], "logprob sum", round(float(np.sum(logprobs)), 3))
print("programs", json.dumps({"compiled": engine.runner.num_compiles, "loaded": engine.runner.num_loaded}))

"""logit_bias on a GPU (session 46): a random-weight preset through the engine's GPU kernels. A +100 bias
forces its token (greedy and sampled), a -100 bias bans the greedy choice, a later unbiased request in the
same slots answers as before any bias, and 4 decode iterations per launch give the same tokens as one.

`JAX_PLATFORMS=cuda PRESET=llama-3.2-1b QUANT=int4 python notebooks/gpu_logit_bias_check.py`; PRESET=tiny on a CPU.
Prints one JSON line; exit 1 if a check fails.
"""
from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp

from atlasjax import LLM, SamplingParams
from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig

PRESET, QUANT = os.environ.get("PRESET", "tiny"), os.environ.get("QUANT") or None
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]


def llm(steps: int) -> LLM:
    dtype = jnp.bfloat16 if os.environ.get("JAX_PLATFORMS", "").startswith("cuda") else jnp.float32
    loaded = load_preset(PRESET, dtype, QUANT)
    return LLM.from_engine(LLMEngine(EngineConfig(max_num_seqs=8, max_model_len=256, num_scheduler_steps=steps,
                                                  quantization=QUANT), loaded=loaded))


def ids(model: LLM, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=8, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids for o in model.generate(PROMPTS, params)]


def main() -> int:
    one, four = llm(1), llm(4)
    base = ids(one)
    checks = dict(
        forced=ids(one, logit_bias={42: 100}) == [[42] * 8] * 2,
        forced_sampled=ids(one, temperature=1.0, seed=1, logit_bias={42: 100}) == [[42] * 8] * 2,
        banned=all(b[0] != t[0] for b, t in zip(ids(one, logit_bias={base[0][0]: -100, base[1][0]: -100}), base)),
        clean_after=ids(one) == base,
        multi_step_equal=ids(four, logit_bias={5: 3.0, base[0][1]: -100}) == ids(one, logit_bias={5: 3.0,
                                                                                              base[0][1]: -100}),
    )
    print(json.dumps(dict(preset=PRESET, quantization=QUANT, checks=checks)))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Sleep mode on a GPU: device memory in use before / after `LLM.sleep(level)` and after `wake_up`, the time
each takes, and whether greedy text is the same after waking (level 1) and after level 2 + update_params.

    python notebooks/gpu_sleep_mode.py --preset llama-3.1-8b [--output out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import jax


def in_use() -> int:
    return jax.devices()[0].memory_stats()["bytes_in_use"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    from atlasjax import LLM, SamplingParams
    from atlasjax.bench.presets import load_preset
    from atlasjax.engine import LLMEngine, resolve_dtype
    from atlasjax.engine_config import EngineConfig
    engine = LLMEngine(EngineConfig(max_num_seqs=8, max_model_len=2048),
                       loaded=load_preset(args.preset, resolve_dtype("auto")))
    llm = LLM.from_engine(engine)
    prompt, greedy = list(range(100, 164)), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    before = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    out = dict(preset=args.preset, device=jax.devices()[0].device_kind, awake_bytes=in_use())
    for level in (1, 2):
        host = jax.device_get(llm.params) if level == 2 else None
        t0 = time.perf_counter()
        llm.sleep(level=level)
        out[f"sleep{level}_s"] = time.perf_counter() - t0
        out[f"asleep{level}_bytes"] = in_use()
        t0 = time.perf_counter()
        llm.wake_up()
        if level == 2:
            llm.update_params(host)
        jax.block_until_ready(llm.params)
        out[f"wake{level}_s"] = time.perf_counter() - t0
        out[f"woken{level}_bytes"] = in_use()
        out[f"same_tokens_after_level{level}"] = llm.generate([prompt], greedy)[0].outputs[0].token_ids == before
    print(json.dumps(out, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

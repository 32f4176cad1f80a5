"""Session 77: what an EAGLE-3 verify step costs on Llama-3.1-8B shapes (bf16, random weights, one H200).

No real checkpoint pair can reach the device, so two random heads of the published Llama-3.1-8B head's shapes
(one layer, hidden 4096, 32,000-token draft vocabulary) bound it:
  - "all": its d2t maps every draft id to token 1000, which a +100 logit bias makes the target repeat, so every
    draft is accepted: k + 1 tokens a step, the best case;
  - "none": a random d2t; its drafts are (almost) never accepted: one token a step, the worst case.
Both against the default engine (no speculation) on the same prompts (128 random tokens, 128 out, greedy with the
bias), for batches of 1 and 8:
  KS="1 3 5" python3 notebooks/gpu_eagle3_step_cost.py 1 8     # -> $OUT/eagle3_step_cost.json
"""
import gc
import json
import os
import sys
import time

import numpy as np

from atlasjax.bench.__main__ import build_parser
from atlasjax.bench.presets import build_engine
from atlasjax.eagle3 import make_tensors
from atlasjax.sampling_params import SamplingParams

OUT = os.environ.get("OUT", ".")
TOKEN = 1000
results = []


def head(kind: str) -> str:
    """A random EAGLE-3 head for the 8B preset, saved as a checkpoint directory (float32 safetensors)."""
    from safetensors.numpy import save_file
    path = f"/tmp/eagle3_{kind}"
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
          "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1,
          "vocab_size": 128256, "draft_vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "max_position_embeddings": 131072}
    tensors = make_tensors(hf, 4096, np.random.default_rng(0))
    if kind == "all":
        tensors["d2t"] = (TOKEN - np.arange(32000)).astype(np.int64)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    return path


def run(label, batch, *flags):
    args = build_parser().parse_args(["latency", "--preset", "llama-3.1-8b", "--batch-size", str(batch), *flags])
    t0 = time.perf_counter()
    engine = build_engine(args, max_num_seqs=batch, max_model_len=512, max_num_batched_tokens=256)
    start_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, logit_bias={TOKEN: 100.0})
    per_iter = []
    for it in range(3):   # the first compiles
        ids = [f"{it}-{b}" for b in range(batch)]
        for rid in ids:
            engine.add_request(rid, rng.integers(0, 128000, 128).tolist(), params)
        reqs = [engine.requests[r][0] for r in ids]
        steps = []
        while engine.has_unfinished():
            decoding = all(r.output_token_ids for r in reqs)
            n0 = sum(len(r.output_token_ids) for r in reqs)
            t0 = time.perf_counter()
            engine.step()
            if decoding:
                steps.append((time.perf_counter() - t0, (sum(len(r.output_token_ids) for r in reqs) - n0) / batch))
        for rid in ids:
            engine.release(rid)
        if it:
            per_iter += steps
    step_s = float(np.median([s for s, _ in per_iter]))
    tokens = float(np.mean([n for _, n in per_iter]))
    tpot = float(np.sum([s for s, _ in per_iter]) / np.sum([n for _, n in per_iter]))
    row = dict(label=label, batch=batch, median_step_ms=step_s * 1e3, tokens_per_step=tokens, tpot_ms=tpot * 1e3,
               engine_start_s=start_s, spec=vars(engine.stats.spec))
    print(json.dumps(row), flush=True)
    results.append(row)
    del engine
    gc.collect()


def eagle(kind, k):
    return ["--speculative-config", json.dumps({"method": "eagle3", "model": head(kind), "num_speculative_tokens": k})]


for batch in [int(b) for b in sys.argv[1:]] or [1]:
    run("default", batch)
    for k in map(int, os.environ.get("KS", "1 3 5").split()):
        run(f"eagle3 k={k}, all accepted", batch, *eagle("all", k))
    run("eagle3 k=3, none accepted", batch, *eagle("none", 3))
json.dump(results, open(os.path.join(OUT, "eagle3_step_cost.json"), "w"), indent=1)

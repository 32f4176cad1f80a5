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
import json
import os
import sys

import numpy as np

from atlasjax.eagle3 import make_tensors
from notebooks.gpu_spec_step_cost import OUT, results, run   # the same timing loop (the bias is toward token 1000)

TOKEN = 1000


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


def eagle(kind, k):
    return ["--speculative-config", json.dumps({"method": "eagle3", "model": head(kind), "num_speculative_tokens": k})]


if __name__ == "__main__":
    for batch in [int(b) for b in sys.argv[1:]] or [1]:
        run("default", batch)
        for k in map(int, os.environ.get("KS", "1 3 5").split()):
            run(f"eagle3 k={k}, all accepted", batch, *eagle("all", k))
        run("eagle3 k=3, none accepted", batch, *eagle("none", 3))
    json.dump(results, open(os.path.join(OUT, "eagle3_step_cost.json"), "w"), indent=1)

"""Session 78: verify rounds per launch (atlasjax/verify_rounds.py) on Llama-3.1-8B shapes (bf16, random weights,
one H200). The same timing loop and random EAGLE-3 heads as session 77 (notebooks/gpu_eagle3_step_cost.py: "all"
accepted under a +100 logit bias, "none" accepted), and a Llama-3.2-1B-shaped random draft model (none accepted),
each with one verify round per launch (`--num-scheduler-steps 1`, session 77's engine) and with four (the GPU
default), against the default engine (no speculation, 4 decode iterations per launch):
  python3 notebooks/gpu_verify_rounds.py 1      # batch sizes -> $OUT/verify_rounds.json
"""
import json
import os
import sys

from notebooks.gpu_eagle3_step_cost import eagle
from notebooks.gpu_spec_step_cost import OUT, results, run


def draft_model(k):
    return ["--speculative-config", json.dumps({"model": "preset:llama-3.2-1b", "num_speculative_tokens": k})]


if __name__ == "__main__":
    for batch in [int(b) for b in sys.argv[1:]] or [1]:
        run("default", batch)
        for rounds in (1, 4):
            steps = ["--num-scheduler-steps", str(rounds)]
            run(f"eagle3 k=3, all accepted, {rounds} rounds", batch, *eagle("all", 3), *steps)
            run(f"eagle3 k=3, none accepted, {rounds} rounds", batch, *eagle("none", 3), *steps)
            run(f"draft model 1B k=3, none accepted, {rounds} rounds", batch, *draft_model(3), *steps)
        run("eagle3 k=5, all accepted, 4 rounds", batch, *eagle("all", 5))
    json.dump(results, open(os.path.join(OUT, f"verify_rounds_{'_'.join(sys.argv[1:]) or '1'}.json"), "w"),
              indent=1)

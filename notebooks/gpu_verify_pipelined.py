"""Session 79: pipelined verify-rounds launches (the next launch scheduled while this one runs, its requests moved
along on the device; atlasjax/verify_rounds.py) against each launch read back first (ATLASJAX_PIPELINE_VERIFY=off,
session 78's engine). Llama-3.1-8B shapes (bf16, random weights, one H200), 4 rounds per launch (the GPU default),
the random EAGLE-3 heads of session 77 ("all" drafts accepted under a +100 logit bias, "none") and a
Llama-3.2-1B-shaped random draft model (none accepted), against the default engine (no speculation):
  python3 notebooks/gpu_verify_pipelined.py 1      # batch sizes -> $OUT/verify_pipelined_<sizes>.json
"""
import json
import os
import sys

from notebooks.gpu_eagle3_step_cost import eagle
from notebooks.gpu_spec_step_cost import OUT, results, run
from notebooks.gpu_verify_rounds import draft_model


def both(label, batch, *flags):
    for mode in ("off", "on"):
        os.environ["ATLASJAX_PIPELINE_VERIFY"] = mode
        run(f"{label}, pipelined {mode}", batch, *flags)


def rounds_sweep(batch):
    """Pipelined, the rounds per launch (num_scheduler_steps) that suit it: ROUNDS=1 python3 ... 1"""
    for rounds in (2, 8):
        run(f"eagle3 k=3, all accepted, {rounds} rounds", batch, *eagle("all", 3), "--num-scheduler-steps", str(rounds))
    run("eagle3 k=3, none accepted, 8 rounds", batch, *eagle("none", 3), "--num-scheduler-steps", "8")
    run("eagle3 k=5, all accepted, 4 rounds", batch, *eagle("all", 5))


if __name__ == "__main__" and os.environ.get("ROUNDS") == "1":
    for batch in [int(b) for b in sys.argv[1:]] or [1]:
        rounds_sweep(batch)
    json.dump(results, open(os.path.join(OUT, "verify_pipelined_rounds.json"), "w"), indent=1)
elif __name__ == "__main__":
    for batch in [int(b) for b in sys.argv[1:]] or [1]:
        run("default", batch)
        both("eagle3 k=3, all accepted", batch, *eagle("all", 3))
        both("eagle3 k=3, none accepted", batch, *eagle("none", 3))
        if os.environ.get("DRAFT_MODEL", "1") == "1":
            both("draft model 1B k=3, none accepted", batch, *draft_model(3))
    json.dump(results, open(os.path.join(OUT, f"verify_pipelined_{'_'.join(sys.argv[1:]) or '1'}.json"), "w"),
              indent=1)

"""Session 81: the n-gram acceptance gate (atlasjax/ngram_gate.py) against drafting wherever a lookup finds one
(ATLASJAX_NGRAM_GATE=off). Llama-3.1-8B shapes (bf16, random weights, one H200), 128-token random prompts, 128 out,
greedy, k=4, n-grams 1-3, 4 verify rounds per launch pipelined (the GPU default). A +100 logit bias on N tokens makes
the random model pick among them: N=1 every draft is accepted, N=2 about a quarter, N=16 hardly any (drafts are found
in most rounds: short n-grams recur among 16 tokens):
  python3 notebooks/gpu_ngram_gate.py 1 8      # batch sizes -> $OUT/ngram_gate.json
BIASED="16" runs one bias only; WARMUP=2 times two iterations after two untimed ones (one by default).
"""
import json
import os
import sys

import notebooks.gpu_spec_step_cost as cost
from notebooks.gpu_ngram_on_device import K4

if __name__ == "__main__":
    for batch in [int(b) for b in sys.argv[1:]] or [1]:
        for n in [int(n) for n in os.environ.get("BIASED", "16 2 1").split()]:
            cost.bias_tokens(n)
            if n != 1 and os.environ.get("DEFAULT", "1") == "1":
                cost.run(f"default, {n} biased", batch)
            for gate in (("on", "off") if n != 1 else ("on",)):
                os.environ["ATLASJAX_NGRAM_GATE"] = gate
                cost.run(f"ngram k=4, device lookups, pipelined, gate {gate}, {n} biased", batch, *K4)
    json.dump(cost.results, open(os.path.join(cost.OUT, "ngram_gate.json"), "w"), indent=1)

"""Session 80: n-gram drafts looked up on the device (atlasjax/ngram_lookup.py) in pipelined launches of 4 verify
rounds, against the host's lookups one round per launch (`--num-scheduler-steps 1`, how n-gram speculation ran every
verify launch before) and the device's with each launch read back first (ATLASJAX_PIPELINE_VERIFY=off).
Llama-3.1-8B shapes (bf16, random weights, one H200); a +100 logit bias makes the random model repeat one token, so
every draft is accepted (gpu_spec_step_cost.py's method); 128-token random prompts, 128 out, k=4:
  python3 notebooks/gpu_ngram_on_device.py 1 8      # batch sizes -> $OUT/ngram_on_device_1_8.json
MIXED=N instead biases N tokens alike (+100 each, N >= 2; MIXED=1 means 2: the model picks among them, so drafts are
accepted in part, and with many tokens hardly ever) and runs the default engine, the host's lookups and the device's
pipelined and read back first. LONG=1 also runs bs=1 and 8 pipelined with a 32k
max_model_len (each round looks up 32k positions per request).
"""
import json
import os
import sys

import notebooks.gpu_spec_step_cost as cost

K4 = ["--speculative-config", json.dumps({"num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                          "prompt_lookup_min": 1})]


def ngram(label, batch, *flags, pipeline="on"):
    os.environ["ATLASJAX_PIPELINE_VERIFY"] = pipeline
    cost.run(label, batch, *K4, *flags)


if __name__ == "__main__" and os.environ.get("MIXED"):
    biased = max(2, int(os.environ["MIXED"]))
    cost.bias_tokens(biased)
    tag = f"{biased} tokens biased"
    for batch in [int(b) for b in sys.argv[1:]] or [1]:
        cost.run(f"default, {tag}", batch)
        ngram(f"ngram k=4, host lookups, 1 round per launch, {tag}", batch, "--num-scheduler-steps", "1")
        if biased > 2:
            ngram(f"ngram k=4, device lookups, 4 rounds, read back first, {tag}", batch, pipeline="off")
        ngram(f"ngram k=4, device lookups, 4 rounds, pipelined, {tag}", batch)
    name = "mixed" if biased == 2 else f"mixed_{biased}"
    json.dump(cost.results, open(os.path.join(cost.OUT, f"ngram_on_device_{name}.json"), "w"), indent=1)
elif __name__ == "__main__":
    for batch in [int(b) for b in sys.argv[1:]] or [1]:
        cost.run("default", batch)
        ngram("ngram k=4, host lookups, 1 round per launch", batch, "--num-scheduler-steps", "1")
        ngram("ngram k=4, device lookups, 4 rounds, read back first", batch, pipeline="off")
        ngram("ngram k=4, device lookups, 4 rounds, pipelined", batch)
    if os.environ.get("LONG") == "1":
        os.environ["MAX_MODEL_LEN"] = "32768"
        for batch in [int(b) for b in sys.argv[1:]] or [1]:
            ngram("ngram k=4, device lookups, 4 rounds, pipelined, max_model_len 32768", batch)
    json.dump(cost.results, open(os.path.join(cost.OUT, f"ngram_on_device_{'_'.join(sys.argv[1:]) or '1'}.json"), "w"),
              indent=1)

"""Session 66: what a speculative step costs on Llama-3.1-8B shapes (bf16, random weights, one H200).

A logit bias of +100 on one token makes the random model repeat it, so every n-gram draft is accepted: a
verify step with k drafts then gives k + 1 tokens, and its time per step is the cost of verifying k drafts.
Both sides run the same (full) sampling plan, for 1 and 8 requests of a 128-token random prompt, 128 out:
  default engine (async scheduling, 4 decode iterations per launch), synchronous one step per launch, and
  n-gram speculation with k = 1, 2, 4, 8.
  KS="1 2 4 8" python3 notebooks/gpu_spec_step_cost.py 1 8     # batch sizes -> $OUT/spec_step_cost.json
"""
import gc
import json
import os
import sys
import time

import numpy as np

from atlasjax.bench.__main__ import build_parser
from atlasjax.bench.presets import build_engine
from atlasjax.sampling_params import SamplingParams

OUT = os.environ.get("OUT", ".")
results = []


def bias_tokens(n):
    """+100 on n tokens alike for the runs that follow (LOGIT_BIAS): the random model picks among them."""
    os.environ["LOGIT_BIAS"] = json.dumps({str(1000 + i): 100.0 for i in range(n)})


def run(label, batch, *flags):
    args = build_parser().parse_args(["latency", "--preset", "llama-3.1-8b", "--batch-size", str(batch), *flags])
    t0 = time.perf_counter()
    engine = build_engine(args, max_num_seqs=batch, max_model_len=int(os.environ.get("MAX_MODEL_LEN", "512")),
                          max_num_batched_tokens=256)
    start_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    bias = {int(t): v for t, v in json.loads(os.environ.get("LOGIT_BIAS", '{"1000": 100.0}')).items()}
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, logit_bias=bias)
    per_iter = []
    warm = int(os.environ.get("WARMUP", "1"))   # untimed iterations first: they compile
    for it in range(warm + 2):
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
        if it >= warm:
            per_iter += steps
    step_s = float(np.median([s for s, _ in per_iter]))
    tokens = float(np.mean([n for _, n in per_iter]))
    tpot = float(np.sum([s for s, _ in per_iter]) / np.sum([n for _, n in per_iter]))
    row = dict(label=label, batch=batch, median_step_ms=step_s * 1e3, tokens_per_step=tokens, tpot_ms=tpot * 1e3,
               read_wait_s=engine.stats.read_wait_seconds, engine_start_s=start_s, spec=vars(engine.stats.spec))
    print(json.dumps(row), flush=True)
    results.append(row)
    del engine
    gc.collect()


def spec(k):
    return ["--speculative-config", json.dumps({"num_speculative_tokens": k, "prompt_lookup_max": 3,
                                                "prompt_lookup_min": 1})]


if __name__ == "__main__":
    for batch in [int(b) for b in sys.argv[1:]] or [1]:
        run("default", batch)
        run("sync", batch, "--no-async-scheduling", "--num-scheduler-steps", "1")
        for k in map(int, os.environ.get("KS", "1 2 4 8").split()):
            run(f"k{k}", batch, *spec(k))
    json.dump(results, open(os.path.join(OUT, "spec_step_cost.json"), "w"), indent=1)

"""Session 66: a verify step's device cost against a decode step's, by sampling plan (Llama-3.1-8B shapes, bf16,
random weights, one H200). One request of 128 prompt tokens is prefilled; then the same decode-only step is
launched and read back 30 times (greedy first and last, the sampled plan between) as a plain 8-row decode and as verify steps of k = 1, 4, 8, 15 drafts (a
16-token prefill bucket), greedy and with the full sampling plan (temperature 0.8, top-p 0.9). Each launch is
timed host to host (dispatch + device + read back); nothing is appended, so every launch is the same.
  python3 notebooks/gpu_verify_cost.py         # -> $OUT/verify_cost.json
"""
import json
import os
import time

import numpy as np

from atlasjax.bench.__main__ import build_parser
from atlasjax.bench.presets import build_engine
from atlasjax.sampling_params import SamplingParams
from atlasjax.scheduler_output import SchedulerOutput
from atlasjax.step_readback import read_back

args = build_parser().parse_args(["latency", "--preset", "llama-3.1-8b", "--batch-size", "1", "--speculative-config",
                                  json.dumps({"num_speculative_tokens": 15, "prompt_lookup_min": 1})])
engine = build_engine(args, max_num_seqs=1, max_model_len=512, max_num_batched_tokens=256)
engine.async_scheduling = False   # step() reads its own step back: the prefill's token is known after it
rows = []
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=64, ignore_eos=True)
for label, params in (("greedy", GREEDY), ("sampled", SAMPLED), ("greedy2", GREEDY)):   # greedy again, warm
    engine.add_request(label, np.random.default_rng(0).integers(0, 128000, 128).tolist(), params)
    req = engine.requests[label][0]
    engine.step()                                 # the prefill: one token out
    engine.scheduler._allocate_for(req, req.num_tokens + 16)

    def timed(launch, n=30):
        out = []
        for i in range(n + 3):
            t0 = time.perf_counter()
            step = launch()
            read_back(step, engine.num_slots)
            dt = time.perf_counter() - t0
            req.num_pending_tokens, req.num_steps_in_flight = 0, 0
            if i >= 3:
                out.append(dt)
        return float(np.median(out)) * 1e3
    row = dict(plan=label, decode_ms=timed(lambda: engine.launcher.launch(SchedulerOutput([req], [], [], []), None)))
    for k in (1, 4, 8, 15):
        sched = SchedulerOutput([req], [], [], [], drafts={req: list(range(5, 5 + k))})
        row[f"verify_k{k}_ms"] = timed(lambda: engine.launcher.launch(sched, None))
    print(json.dumps(row), flush=True)
    rows.append(row)
    engine.abort(label)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "verify_cost.json"), "w"), indent=1)

"""Session 66: a greedy verify step (k=4 drafts) against an 8-row greedy decode step, alternating in one process
(Llama-3.1-8B shapes, bf16, random weights, one H200), and against the same verify run with the full sampling
plan. Host-to-host times (dispatch, device, read back), median of 40 launches, three rounds. Needs a temporary
switch in the verify launch (then LLMEngine._launch_verify; atlasjax/step_launch.py now) (ATLASJAX_VERIFY_FULL=on: the plan with greedy=False), which session 66
measured and removed again (the greedy plan was the faster one):
  python3 notebooks/gpu_verify_plan_ab.py
"""
import json, os, time
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
engine.add_request("g", np.random.default_rng(0).integers(0, 128000, 128).tolist(), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
req = engine.requests["g"][0]
engine.step()
engine.scheduler._allocate_for(req, req.num_tokens + 16)
def timed(launch, n=40):
    out = []
    for i in range(n + 3):
        t0 = time.perf_counter(); read_back(launch(), engine.num_slots); dt = time.perf_counter() - t0
        req.num_pending_tokens, req.num_steps_in_flight = 0, 0
        if i >= 3: out.append(dt)
    return round(float(np.median(out)) * 1e3, 3)
sched = SchedulerOutput([req], [], [], [], drafts={req: [5, 6, 7, 8]})
for rep in range(3):
    for full in ("off", "on"):
        os.environ["ATLASJAX_VERIFY_FULL"] = full
        print(json.dumps(dict(rep=rep, verify_full_plan=full, decode_ms=timed(lambda: engine.launcher.launch(SchedulerOutput([req], [], [], []), None)),
                              verify_k4_ms=timed(lambda: engine.launcher.launch(sched, None)))), flush=True)

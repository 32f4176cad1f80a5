"""What the fourth sampling plan (sampled without logprobs, session 64) costs a server's start: runs
`python -m atlasjax.bench` with its arguments, after narrowing the sampling plans to the three there were
before it when PLANS=3. Run each variant in a process of its own (jax's caches stay per process):

    PLANS=3 python notebooks/gpu_compile_plans.py latency --preset llama-3.1-8b ... --compile-at-start -v
    PLANS=4 python notebooks/gpu_compile_plans.py latency ...

The `compiled N step shapes ... in S s` log line gives the count and the time.
"""
import os
import sys

from atlasjax import sampling
from atlasjax.bench.__main__ import main

if os.environ.get("PLANS") == "3":
    before = (sampling.SamplingPlan(True, False), sampling.SamplingPlan(True, True), sampling.FULL)
    sampling.SamplingPlan.variants = staticmethod(lambda: before)
print("sampling plans:", sampling.SamplingPlan.variants(), flush=True)
sys.exit(main(sys.argv[1:]))

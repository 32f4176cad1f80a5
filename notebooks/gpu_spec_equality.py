"""Session 67: which settings make n-gram speculation's tokens differ from plain decoding on a GPU (the helper's H200
run of tests/test_speculative.py: 4 failures; CPU: equal). The test's seeded and greedy requests on the tiny random
Llama, plain against speculative, for dtype x scheduling (async or not) x iterations per launch.
    python3 notebooks/gpu_spec_equality.py      # on a GPU (tests.hf_models needs torch)
"""
import sys

sys.path.insert(0, ".")
from tests.hf_models import make_hf_model  # noqa: E402
from tests.test_speculative import ENGINE, LOOP, NGRAM  # noqa: E402

from atlasjax import LLM, SamplingParams  # noqa: E402

model = "/tmp/spec_equality_model"
make_hf_model("llama_gqa4", model)
prompts = [LOOP, [5, 9, 5, 9, 5]]
seeded = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.5, min_p=0.05, seed=4, max_tokens=12, min_tokens=6)]
greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
for dtype, async_scheduling, steps in (("bfloat16", False, 1), ("bfloat16", True, 1), ("bfloat16", True, 4),
                                       ("float32", True, 4)):
    kw = dict(ENGINE, dtype=dtype, async_scheduling=async_scheduling, num_scheduler_steps=steps)
    plain, spec = LLM(model, **kw), LLM(model, speculative_config=NGRAM, **kw)
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids
            for params in (seeded, greedy) for a, b in zip(plain.generate(prompts, params), spec.generate(prompts, params))]
    print(f"{dtype} async={async_scheduling} steps={steps}: equal {same} {spec.engine.stats.spec}", flush=True)

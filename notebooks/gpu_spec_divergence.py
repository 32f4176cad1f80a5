"""Session 68: where n-gram speculation's tokens part from plain decoding on a GPU in bf16 (session 67: 4 of 17
tests/test_speculative.py tests), is the chosen token's margin within bf16 rounding? For each setting and
request, the first differing position, plain's top-2 logprob gap there and both engines' logprobs of the two
tokens. A gap of a few hundredths (bf16 keeps ~3 significant digits) says rounding; a wide gap says a bug.
    python3 notebooks/gpu_spec_divergence.py      # on a GPU (tests.hf_models needs torch)
"""
import sys

sys.path.insert(0, ".")
from tests.hf_models import make_hf_model  # noqa: E402
from tests.test_speculative import ENGINE, LOOP, NGRAM  # noqa: E402

from atlasjax import LLM, SamplingParams  # noqa: E402

model = "/tmp/spec_divergence_model"
make_hf_model("llama_gqa4", model)
prompts = [LOOP, list(range(3, 40)), [5, 9, 5, 9, 5, 9], [5, 9, 5, 9, 5]]
cases = {"greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5),
         "seeded": SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True,
                                  logprobs=5)}
for dtype, async_scheduling, steps in (("bfloat16", True, 4), ("bfloat16", False, 1), ("float32", True, 4)):
    kw = dict(ENGINE, dtype=dtype, async_scheduling=async_scheduling, num_scheduler_steps=steps)
    plain, spec = LLM(model, **kw), LLM(model, speculative_config=NGRAM, **kw)
    for name, params in cases.items():
        for p, a, b in zip(prompts, plain.generate(prompts, params), spec.generate(prompts, params)):
            a, b = a.outputs[0], b.outputs[0]
            diff = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            if diff is None:
                print(f"{dtype} async={async_scheduling} steps={steps} {name} prompt{len(p)}: equal", flush=True)
                continue
            top = sorted(a.logprobs[diff].items(), key=lambda kv: -kv[1].logprob)
            x, y = a.token_ids[diff], b.token_ids[diff]
            lp_b = {t: v.logprob for t, v in b.logprobs[diff].items()}
            lp_y = a.logprobs[diff][y].logprob if y in a.logprobs[diff] else None
            print(f"{dtype} async={async_scheduling} steps={steps} {name} prompt{len(p)}: differ at {diff}: plain "
                  f"{x} spec {y}; plain top2 gap {top[0][1].logprob - top[1][1].logprob:.4f}; plain lp "
                  f"{x}:{a.logprobs[diff][x].logprob:.4f} {y}:{lp_y}; spec lp {lp_b}", flush=True)
    print(f"{dtype} async={async_scheduling} steps={steps}: {spec.engine.stats.spec}", flush=True)

"""Session 68: tests/test_speculative.py's seeded test on an H200 in bf16 (min_p=0.05, temperature 0.5, seed 4):
plain and speculative tokens differ at single positions. Print, at each differing position, both engines'
logprobs of the two tokens and of the top token, to see whether the draw sits on a min_p / rounding boundary.
    python3 notebooks/gpu_spec_seeded_flip.py      # on a GPU (tests.hf_models needs torch)
"""
import math
import sys

sys.path.insert(0, ".")
from tests.hf_models import make_hf_model  # noqa: E402
from tests.test_speculative import ENGINE, LOOP, NGRAM  # noqa: E402

from atlasjax import LLM, SamplingParams  # noqa: E402

model = "/tmp/spec_flip_model"
make_hf_model("llama_gqa4", model)
plain, spec = LLM(model, **ENGINE), LLM(model, speculative_config=NGRAM, **ENGINE)
prompts = [LOOP, [5, 9, 5, 9, 5]]
for k in (3, 20):
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True,
                             logprobs=k),
              SamplingParams(temperature=0.5, min_p=0.05, seed=4, max_tokens=12, min_tokens=6, logprobs=k)]
    for n, (a, b) in enumerate(zip(plain.generate(prompts, params), spec.generate(prompts, params))):
        a, b = a.outputs[0], b.outputs[0]
        first = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        # up to the first differing token the contexts are equal: its logprobs differ only by rounding
        worst = max(abs(a.logprobs[j][t].logprob - b.logprobs[j][t].logprob)
                    for j, t in enumerate(a.token_ids[:first]) if t in b.logprobs[j])
        print(f"logprobs={k} request {n}: equal={a.token_ids == b.token_ids} plain {a.token_ids} spec {b.token_ids} "
              f"max |lp diff| before the first difference {worst}", flush=True)
        for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x == y:
                continue
            la, lb = a.logprobs[j], b.logprobs[j]
            top = max(la.values(), key=lambda v: v.logprob).logprob
            fmt = lambda d, t: f"{d[t].logprob:.4f}" if t in d else "-"  # noqa: E731
            print(f"  pos {j}: plain {x} spec {y}; plain lp {x}:{fmt(la, x)} {y}:{fmt(la, y)}; "
                  f"spec lp {x}:{fmt(lb, x)} {y}:{fmt(lb, y)}; top lp {top:.4f}; min_p cut lp {top + math.log(0.05):.4f}", flush=True)

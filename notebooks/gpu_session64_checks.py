"""Session 64's new paths on a GPU (CI has none): beam search and weight updates through the Pallas
kernels, bf16 and fp8. A tiny random Llama (tests/hf_models.py, torch) saved to a temporary directory.

    JAX_PLATFORMS=cuda python notebooks/gpu_session64_checks.py
"""
import tempfile
import time

import numpy as np

from atlasjax import LLM, BeamSearchParams, SamplingParams
from tests.hf_models import make_hf_model

KW = dict(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=128)
dirs = [tempfile.mkdtemp() for _ in range(2)]
for seed, d in enumerate(dirs):
    make_hf_model("llama_gqa4", d, seed=seed)
prompt = list(range(5, 45))
for quant in (None, "fp8"):
    a, b = (LLM(d, quantization=quant, **KW) for d in dirs)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    want_a, want_b = (x.generate([prompt], greedy)[0].outputs[0].token_ids for x in (a, b))
    t0 = time.perf_counter()
    beams = a.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=12))[0].sequences
    seconds = time.perf_counter() - t0
    width1 = a.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=12))[0].sequences[0]
    print(f"{quant or 'bf16'}: beam search width 4, 12 tokens: {seconds:.2f} s (compiles included); "
          f"scores {[round(s.cum_logprob, 3) for s in beams]}; width 1 == greedy: {width1.output_token_ids == want_a}")
    old = a.params
    a.update_params(b.params)
    swapped = a.generate([prompt], greedy)[0]
    print(f"{quant or 'bf16'}: after update_params the engine answers as the other: "
          f"{swapped.outputs[0].token_ids == want_b} (cached tokens {swapped.num_cached_tokens}); "
          f"forward max diff {np.abs(a.forward([prompt])[0] - b.forward([prompt])[0]).max():.2e}")
    a.update_params(old)
    print(f"{quant or 'bf16'}: restored: {a.generate([prompt], greedy)[0].outputs[0].token_ids == want_a}")
    del a, b

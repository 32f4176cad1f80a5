"""GPU: greedy generation through the Pallas attention kernels equals the jnp reference, on real weights.

The embedded SmolLM2-135M-Instruct GGUF (real trained weights: no near-tie flips as with random
ones), bf16, 9 query / 3 KV heads (group 3), head_dim 64; page sizes 16 and 64; prompts from 35 to
~1,400 tokens (several prefill chunks, many pages). A 4-bit 135M model has many near-ties (top-2
logprob gaps under 0.1), where bf16 rounding may flip a greedy choice either way; so the second part
teacher-forces the float32 reference's greedy continuations through both bf16 paths and measures
each path's logprob error against float32. Writes $OUT/e2e_real.json.

  JAX_PLATFORMS=cuda GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf python notebooks/gpu_e2e_real_weights.py
"""
import json
import os

import jax
import numpy as np

from atlasjax import LLM, SamplingParams

OUT = os.environ.get("OUT", "/tmp")
GGUF = os.environ["GGUF"]
res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain what a GPU is in one sentence.", "Translate 'good morning' into Spanish.",
             "Summarize this text: " + " ".join(["The quick brown fox jumps over the lazy dog."] * 60),
             "Count from one to fifty in words: " + ", ".join(str(i) for i in range(1, 300))]


def run(backend, page_size):
    llm = LLM(GGUF, dtype="bfloat16", attention_backend=backend, page_size=page_size, max_num_seqs=8,
              max_model_len=2048, max_num_batched_tokens=512)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, logprobs=0))
    lens = [len(o.prompt_token_ids) for o in outs]
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return lens, toks, lps, outs[0].outputs[0].text


for ps in (16, 64) if os.environ.get("GREEDY", "1") == "1" else ():
    lens, ref_t, ref_lp, ref_text = run("reference", ps)
    _, pal_t, pal_lp, pal_text = run("pallas", ps)
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(pal_t, ref_t)]
    diff = max(float(np.max(np.abs(np.array(a[:k]) - np.array(b[:k])))) if k else 0.0
               for a, b, k in zip(pal_lp, ref_lp, same))
    res[f"page{ps}"] = {"prompt_lens": lens, "generated": [len(t) for t in ref_t], "equal": pal_t == ref_t,
                        "matching_prefix": same, "max_logprob_diff_on_prefix": diff,
                        "first_answer_reference": ref_text, "first_answer_pallas": pal_text}
    print(f"page{ps}", json.dumps(res[f"page{ps}"]), flush=True)
    with open(f"{OUT}/e2e_real.json", "w") as f:
        json.dump(res, f, indent=1)


def teacher_forced(backend, dtype, ids_list):
    llm = LLM(GGUF, dtype=dtype, attention_backend=backend, page_size=16, max_num_seqs=8, max_model_len=2048,
              max_num_batched_tokens=512)
    outs = llm.generate(ids_list, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    return [np.array([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], ids[1:])]) for o, ids in zip(outs, ids_list)]


llm32 = LLM(GGUF, dtype="float32", attention_backend="reference", max_num_seqs=8, max_model_len=2048,
            max_num_batched_tokens=512)
chats = [llm32.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
outs = llm32.generate(chats, SamplingParams(temperature=0, max_tokens=64))
ids = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
del llm32
want = teacher_forced("reference", "float32", ids)
for backend in ("reference", "pallas"):
    got = teacher_forced(backend, "bfloat16", ids)
    err = np.concatenate([np.abs(g - w) for g, w in zip(got, want)])
    res[f"bf16_{backend}_vs_f32"] = {"positions": int(err.size), "mean_abs_logprob_err": float(err.mean()),
                                    "p99": float(np.percentile(err, 99)), "max": float(err.max())}
    print(f"bf16_{backend}_vs_f32", json.dumps(res[f"bf16_{backend}_vs_f32"]), flush=True)
    with open(f"{OUT}/e2e_real.json", "w") as f:
        json.dump(res, f, indent=1)

"""GPU: the embedded SmolLM2 GGUF run on its own quantized blocks (fused kernels; Q4 groups of 32 take
the prescaled path) against the same file dequantized to bf16 at load, greedy, real weights.

Reports per question the tokens both agree on before the first difference, the top-2 logprob gap of
the dequantized run at that position (a near-tie flips either way under bf16 rounding), the first
answer's text, and each path's decode tok/s. Writes $OUT/gguf_kept_quantized.json.

  JAX_PLATFORMS=cuda GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf python notebooks/gpu_gguf_kept_quantized.py
"""
import json
import os
import time

import jax

from atlasjax import LLM, SamplingParams

OUT = os.environ.get("OUT", "/tmp")
GGUF = os.environ["GGUF"]
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain what a GPU is in one sentence.", "Translate 'good morning' into Spanish."]
res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "gguf": os.path.basename(GGUF)}


def run(keep):
    llm = LLM(GGUF, dtype="bfloat16", keep_gguf_quantized=keep, max_num_seqs=8, max_model_len=1024)
    leaves = jax.tree.leaves(llm.engine.runner.params, is_leaf=lambda x: hasattr(x, "qweight"))
    kinds = sorted({f"{x.format}/g{x.group_size}" if hasattr(x, "qweight") else str(x.dtype) for x in leaves})
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    llm.generate(prompts, params)   # compile every bucket this batch uses, then time the same batch
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, kinds, n / dt


kept, kinds_kept, tps_kept = run(True)
deq, kinds_deq, tps_deq = run(False)
rows = []
for q, a, b in zip(QUESTIONS, kept, deq):
    ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
    same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    gap = None
    if same < min(len(ta), len(tb)):
        top = sorted(b.outputs[0].logprobs[same].values(), key=lambda lp: -lp.logprob)[:2]
        gap = round(top[0].logprob - top[1].logprob, 4) if len(top) == 2 else None
    rows.append({"question": q, "tokens_equal_before_first_difference": same, "of": len(tb), "dequantized_top2_gap": gap})
res.update(param_kinds_kept=kinds_kept, param_kinds_dequantized=kinds_deq, rows=rows,
           answer_kept=kept[0].outputs[0].text, answer_dequantized=deq[0].outputs[0].text,
           decode_tok_s_kept=round(tps_kept, 1), decode_tok_s_dequantized=round(tps_deq, 1))
print(json.dumps(res, indent=1))
with open(f"{OUT}/gguf_kept_quantized.json", "w") as f:
    json.dump(res, f, indent=1)

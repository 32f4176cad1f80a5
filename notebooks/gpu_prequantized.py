"""GPU: checkpoints saved quantized (FP8 per channel and in blocks, AWQ, GPTQ, compressed-tensors
int) and a Q4_K_M-style GGUF, each run kept quantized, so the native kernels of every kept format
(fp8 per channel, fp8 groups of 128, int4 groups with zero points or float offsets, int8 groups)
run end to end. The truth is the weights the files mean, run in float32; beside the kept run, the
same weights run dense in bf16 show how far bf16 alone moves a random model's greedy tokens.

A random Llama of hidden 1024 (intermediate 2816, 4 layers, vocab 4096) is written by the test
writers (tests/prequantized_writers.py, tests/gguf_kquant_encoders.py). Per format: the kept
format of down_proj and, for the kept and the dense bf16 run each, how many greedy tokens agree with
the float32 truth before the first difference (4 prompts of 24 tokens) and the largest |logprob|
difference of the chosen tokens before it.
Writes $OUT/prequantized.json.

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks python notebooks/gpu_prequantized.py
  (FORMATS=awq,gptq,...: some of them; SMALL=1: a tiny model, to check the script on a CPU)
"""
import json
import os
import tempfile

import jax
import numpy as np
import torch
import transformers

from atlasjax import LLM, SamplingParams
from tests.prequantized_writers import CONFIGS, write_prequantized

OUT = os.environ.get("OUT", "/tmp")
CONFIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
if os.environ.get("SMALL"):   # a CPU check of the script itself
    CONFIG |= dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
PROMPTS = [[int(t) for t in np.random.RandomState(i).randint(0, CONFIG['vocab_size'], size=20 + 7 * i)] for i in range(4)]
TOKENS = 24


def model():
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    return m.eval()


def run(path, dtype="bfloat16", **kw):
    llm = LLM(path, dtype=dtype, max_num_seqs=4, max_model_len=256, **kw)
    down = llm.engine.runner.params["layers_1"]["mlp"]["down_proj"]["kernel"]
    kind = f"{down.format}/g{down.group_size}" if hasattr(down, "qweight") else str(down.dtype)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=1))
    return kind, [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                  for o in outs]


def compare(kept, dense):
    agree, diffs = [], []
    for (kt, kl), (dt, dl) in zip(kept, dense):
        n = next((i for i, (a, b) in enumerate(zip(kt, dt)) if a != b), len(kt))
        agree.append(n)
        diffs += [abs(a - b) for a, b in zip(kl[:n], dl[:n])]
    return {"agree_tokens": agree, "of": TOKENS, "max_logprob_diff": max(diffs) if diffs else None}


def gguf_q4_k_m(m, path):
    import gguf

    from tests.gguf_kquant_encoders import encode_q4_k, encode_q6_k
    from tests.gguf_writer_util import write_gguf_from_hf
    q = gguf.GGMLQuantizationType

    def encode(name, a):
        if a.ndim == 1 or name in ("token_embd.weight", "output.weight"):
            return a, q.F32
        if name.endswith(("attn_v.weight", "ffn_down.weight")):
            return encode_q6_k(a), q.Q6_K
        return encode_q4_k(a), q.Q4_K
    write_gguf_from_hf({k: v.numpy() for k, v in m.state_dict().items()}, m.config, path, encode=encode)


res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "formats": {}}
with tempfile.TemporaryDirectory() as tmp:
    for fmt in os.environ.get("FORMATS", ",".join(list(CONFIGS) + ["gguf-q4_k_m"])).split(","):
        m = model()
        kept_path, dense_path = os.path.join(tmp, fmt), os.path.join(tmp, fmt + "-dense")
        if fmt == "gguf-q4_k_m":
            kept_path += ".gguf"
            gguf_q4_k_m(m, kept_path)
            kind, kept = run(kept_path, keep_gguf_quantized=True)
            _, dense = run(kept_path, keep_gguf_quantized=False)
            _, truth = run(kept_path, "float32", keep_gguf_quantized=False)
        else:
            write_prequantized(m, kept_path, fmt)          # m now holds what the files mean
            m.save_pretrained(dense_path, safe_serialization=True)
            kind, kept = run(kept_path)
            _, dense = run(dense_path)
            _, truth = run(dense_path, "float32")
        res["formats"][fmt] = {"kept": kind, "kept_vs_f32": compare(kept, truth), "bf16_vs_f32": compare(dense, truth)}
        print(fmt, res["formats"][fmt], flush=True)
with open(os.path.join(OUT, "prequantized.json"), "w") as f:
    json.dump(res, f, indent=1)

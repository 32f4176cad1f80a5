"""GPU: a yarn-scaled model on the engine's kernels (RoPE rotated inside the decode attention kernel, whose
tables carry yarn's attention factor) against Hugging Face transformers (torch, float32) on the same weights.

A Llama of 2 layers, 16 query / 4 KV heads of 128 (the fused-RoPE kernel's layout, as Llama-3.1-8B's), random
weights, yarn factor 4 over a 512-token original context; a 1,800-token prompt. Reports, for the engine in
bf16 with RoPE in the kernel and with it rotated in XLA first (`ATLASJAX_ATTENTION_ROPE=off`, a second
process), and for the engine without the yarn override: the largest and mean |log-prob difference| against HF's
yarn model over the prompt (prefill path) and the generated tokens (decode path), and how many of 32 greedy
tokens equal HF's (from the prompt; and each against HF's choice after the engine's own prefix).

  JAX_PLATFORMS=cuda python notebooks/gpu_yarn_check.py            # writes $OUT/yarn_check.json
"""
import json
import os
import subprocess
import sys

import numpy as np

OUT = os.environ.get("OUT", "/tmp")
MODEL_DIR = "/tmp/yarn_llama"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
PROMPT = [int(t) for t in np.random.RandomState(0).randint(0, 2048, size=1800)]
N = 32


def device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_and_score():
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                      max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.04)
    model.save_pretrained(MODEL_DIR)   # without yarn: the engine gets it through hf_overrides
    config.rope_parameters = dict(YARN, rope_theta=config.rope_parameters["rope_theta"])
    yarn = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, config=config, dtype=torch.float32).to(device())
    with torch.no_grad():
        ids = torch.tensor([PROMPT], device=device())
        greedy = yarn.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
    return yarn, greedy[0, len(PROMPT):].tolist()


def hf_token_logprobs(model, tokens):
    import torch
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device=device())).logits[0].double()
    lp = torch.log_softmax(logits, -1).cpu().numpy()
    # log p(token i+1 | tokens[:i+1]), and HF's greedy choice after tokens[:i+1]
    return lp[np.arange(len(tokens) - 1), tokens[1:]], lp[:-1].argmax(-1)


def engine_run(overrides: bool):
    """In this process: the engine's prompt and decode log-probs and greedy tokens (JSON on stdout)."""
    from atlasjax import LLM, SamplingParams
    llm = LLM(MODEL_DIR, dtype="bfloat16", max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=512,
              hf_overrides={"rope_scaling": YARN} if overrides else None)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=1,
                                                prompt_logprobs=1))[0]
    gen = out.outputs[0].token_ids
    prompt_lp = [out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))]
    decode_lp = [out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(gen)]
    print("RESULT " + json.dumps(dict(tokens=gen, prompt=prompt_lp, decode=decode_lp)))


def run_child(overrides: bool, rope_in_kernel: bool):
    env = dict(os.environ, ATLASJAX_ATTENTION_ROPE="on" if rope_in_kernel else "off")
    proc = subprocess.run([sys.executable, __file__, "engine", "yarn" if overrides else "plain"], env=env,
                          capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"engine run failed:\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main():
    yarn, hf_greedy = make_and_score()
    hf_prompt, _ = hf_token_logprobs(yarn, PROMPT)
    report = {}
    for name, overrides, in_kernel in (("yarn, RoPE in the kernel", True, True),
                                       ("yarn, RoPE in XLA", True, False),
                                       ("no yarn override", False, True)):
        got = run_child(overrides, in_kernel)
        ref, argmax = hf_token_logprobs(yarn, PROMPT + got["tokens"])
        decode_ref = ref[len(PROMPT) - 1:]
        p = np.abs(np.array(got["prompt"]) - hf_prompt)
        d = np.abs(np.array(got["decode"]) - decode_ref)
        report[name] = dict(prompt_max=float(p.max()), prompt_mean=float(p.mean()), decode_max=float(d.max()),
                            decode_mean=float(d.mean()),
                            greedy_equal=sum(a == b for a, b in zip(got["tokens"], hf_greedy)),
                            # each greedy token against HF's choice after the same prefix (bf16 near-ties aside)
                            greedy_as_hf=int(np.sum(np.array(got["tokens"]) == argmax[len(PROMPT) - 1:])))
        print(name, json.dumps(report[name]), flush=True)
    with open(os.path.join(OUT, "yarn_check.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "engine":
        engine_run(sys.argv[2] == "yarn")
    else:
        main()

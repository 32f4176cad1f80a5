"""GPU: the research API (`LLM.forward`, `LLM.model_fn`) on the Pallas kernels, against its jnp reference,
the engine's own prompt scoring, and finite differences; and what a forward pass costs.

For each case (a random-weight preset in bf16, optionally quantized; or the embedded SmolLM2 on its
own 4-bit GGUF weights):
- kernels vs reference: `model_fn()` (Pallas attention and matmuls) against `model_fn(reference=True)`
  (jnp) on the same params and tokens: the largest log-prob difference, mean KL, argmax agreement, and
  whether the kernel program holds Mosaic GPU kernels at all;
- forward vs the engine: each prompt token's log-prob from `LLM.forward` against the engine's
  `prompt_logprobs` (its prefill path), and the greedy next token;
- gradients: `jax.grad` of the mean next-token loss through `model_fn(reference=True)`, finite and
  nonzero, and its directional derivative along a random direction of the final-norm scale against a
  central finite difference (in f32, on an f32 copy of the params);
- time: a jitted forward of B x T tokens, kernels and reference (median of 5, after a warm-up), and
  one jitted value-and-grad.

  JAX_PLATFORMS=cuda [CASES=llama-3.2-1b,llama-3.2-1b:int8,smollm2] python notebooks/gpu_forward_check.py
Appends a line per case to $OUT/forward_check.jsonl.
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax import LLM, SamplingParams
from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig

OUT = os.environ.get("OUT", "/tmp")
CASES = os.environ.get("CASES", "llama-3.2-1b,llama-3.2-1b:int8,smollm2").split(",")
KW = dict(max_num_seqs=4, max_model_len=1024, page_size=16, max_num_batched_tokens=512)


def load(case):
    if case == "smollm2":
        return LLM(**KW)
    preset, _, quant = case.partition(":")
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_pages=256, **KW),
                       load_preset(preset, jnp.bfloat16, quant or None))
    return LLM.from_engine(engine)


def log_softmax(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


def median_time(f, *args, n=5):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def check(case):
    llm = load(case)
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (4, 256)).astype(np.int32)
    params = llm.params
    on_kernels, on_reference = jax.jit(llm.model_fn()), jax.jit(llm.model_fn(reference=True))
    hlo = on_kernels.lower(params, tokens).as_text()
    a, b = log_softmax(on_kernels(params, tokens)), log_softmax(on_reference(params, tokens))
    kl = float(np.mean(np.sum(np.exp(b) * (b - a), -1)))
    row = {"case": case, "kernel_program_has_mosaic_gpu": "mosaic_gpu" in hlo,
           "kernels_vs_reference": {"max_abs_logprob_diff": float(np.abs(a - b).max()), "mean_kl": kl,
                                    "argmax_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1)))}}

    prompt = tokens[0, :100].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    lp = log_softmax(llm.forward(prompt)[0])
    diffs = [abs(out.prompt_logprobs[i][prompt[i]].logprob - lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    row["forward_vs_engine_prompt_logprobs"] = {"max_abs_diff": float(max(diffs)), "mean_abs_diff": float(np.mean(diffs)),
                                                "greedy_token_equal": out.outputs[0].token_ids[0] == int(lp[-1].argmax())}

    fn = llm.model_fn(reference=True)
    short = tokens[:2, :64]

    def loss(p):
        logp = jax.nn.log_softmax(fn(p, short)[:, :-1])
        return -jnp.take_along_axis(logp, short[:, 1:, None], axis=-1).mean()
    value_and_grad = jax.jit(jax.value_and_grad(loss, allow_int=True))
    value, grads = value_and_grad(params)
    leaves = [g for g in jax.tree.leaves(grads) if jnp.issubdtype(g.dtype, jnp.floating)]
    row["grad"] = {"loss": float(value), "all_finite": bool(all(bool(jnp.isfinite(g).all()) for g in leaves)),
                   "global_norm": float(jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves)))}
    # the directional derivative along a random direction of the final norm's scale, in f32
    f32 = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    direction = jnp.asarray(rng.standard_normal(f32["norm"]["scale"].shape), jnp.float32)

    def along(eps):
        p = dict(f32, norm={"scale": f32["norm"]["scale"] + eps * direction})
        return loss(p)
    loss32 = jax.jit(along)
    _, g32 = jax.jit(jax.value_and_grad(loss, allow_int=True))(f32)
    eps = 5e-2   # the KV pool rounds K and V to its dtype: a smaller step mostly measures that rounding
    row["grad"]["directional_analytic_f32"] = float(jnp.vdot(g32["norm"]["scale"], direction))
    row["grad"]["directional_finite_difference_f32"] = float((loss32(eps) - loss32(-eps)) / (2 * eps))

    batch = tokens[:, :256]
    row["time_s"] = {"tokens": int(batch.size),
                     "forward_kernels": median_time(on_kernels, params, batch),
                     "forward_reference": median_time(on_reference, params, batch),
                     "value_and_grad_2x64": median_time(value_and_grad, params)}
    print(json.dumps(row), flush=True)
    return row


for case in CASES:   # each row is appended as it completes (a case may be cut off by a time limit)
    try:
        row = check(case)
    except Exception as e:   # record and go on to the next case
        row = {"case": case, "error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps(row), flush=True)
    row.update(device=str(jax.devices()[0]), jax=jax.__version__)
    with open(os.path.join(OUT, "forward_check.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")

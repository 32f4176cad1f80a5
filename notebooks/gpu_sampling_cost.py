"""What on-device sampling costs per decode step on a GPU, by stage (session 63).

`sampling.sample` on [rows, 128256] f32 logits (Llama 3's vocabulary), each variant jitted and run
ITERS times inside one `lax.fori_loop` (so launch overhead is not timed; each iteration perturbs the
logits so XLA cannot hoist the work out). Variants: the greedy plans, the full plan (what any row
with temperature > 0, penalties, a bias or allowed_token_ids runs), and the full plan's stages alone
(the descending sort that top-k / top-p / min-p filtering needs, the Gumbel draw, top-20 logprobs;
XLA's float sort and one top_k against what `sampling` uses since session 63: a sort of order keys and
a chunked top-k). "full" returns the tokens only, so XLA drops its logprobs; "full, logprobs too" is
what a step pays.
    JAX_PLATFORMS=cuda python notebooks/gpu_sampling_cost.py   # -> $OUT/sampling_cost.json
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp

from atlasjax.sampling import FULL, SamplingPlan, SamplingTensors, _sort_desc, _top_k, pack_rows, sample
from atlasjax.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

VOCAB = int(os.environ.get("VOCAB", 128256))       # (smaller for a CPU smoke run)
ITERS = 50
ROWS = [int(r) for r in os.environ.get("ROWS", "1,8,32,128").split(",")]


def timed(fn, *args) -> float:
    """Seconds per iteration of fn(logits, *args) looped ITERS times on the device."""
    def loop(logits, *rest):
        def body(i, acc):
            out = fn(logits + i.astype(jnp.float32) * 1e-6, *rest)
            return acc + sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out))
        return jax.lax.fori_loop(0, ITERS, body, jnp.float32(0))
    run = jax.jit(loop)
    jax.block_until_ready(run(*args))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, (time.perf_counter() - t) / ITERS)
    return best


def main():
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "vocab": VOCAB, "iters": ITERS, "rows": {}}
    for rows in ROWS:
        key = jax.random.key(rows)
        logits = jax.random.normal(key, (rows, VOCAB), jnp.float32) * 3
        counts = jnp.zeros((rows, VOCAB), jnp.int32)
        mask = jnp.zeros((rows, VOCAB), bool)
        bias = (jnp.full((rows, MAX_LOGIT_BIAS), 2**31 - 1, jnp.int32), jnp.zeros((rows, MAX_LOGIT_BIAS), jnp.float32))
        p = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
        f, i = pack_rows([(p, 7, 3, (1,))] * rows, rows)
        st = SamplingTensors(jnp.asarray(f), jnp.asarray(i))
        res = {
            "greedy": timed(lambda lg: sample(lg, counts, mask, st, SamplingPlan(True, False), bias)[0], logits),
            "greedy+logprobs": timed(lambda lg: sample(lg, counts, mask, st, SamplingPlan(True, True), bias)[0],
                                     logits),
            "full": timed(lambda lg: sample(lg, counts, mask, st, FULL, bias)[0], logits),
            "full, logprobs too": timed(lambda lg: sample(lg, counts, mask, st, FULL, bias), logits),
            "sort only": timed(lambda lg: -jnp.sort(-lg, axis=-1), logits),
            "top_k(20) only": timed(lambda lg: jax.lax.top_k(lg, MAX_LOGPROBS)[0], logits),
            "chunked top-20 only": timed(lambda lg: _top_k(lg, MAX_LOGPROBS), logits),
            "key sort only": timed(_sort_desc, logits),
            "log_softmax only": timed(lambda lg: jax.nn.log_softmax(lg, axis=-1), logits),
            "gumbel draw only": timed(lambda lg: jnp.argmax(lg + jax.vmap(lambda k: jax.random.gumbel(
                k, (VOCAB,), jnp.float32))(jax.vmap(lambda s: jax.random.key(s))(jnp.arange(rows))), -1), logits),
        }
        out["rows"][rows] = {k: v * 1e6 for k, v in res.items()}
        print(rows, {k: f"{v * 1e6:.1f} us" for k, v in res.items()}, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "sampling_cost.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

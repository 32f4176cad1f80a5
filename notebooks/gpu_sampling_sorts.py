"""Ways to get what sampling needs from [rows, 128256] f32 logits without XLA's slow float sort (session 63).

The full sampling plan sorts every row (top-k / top-p / min-p thresholds) and takes the top 20
(logprobs); on an H200 each costs ~0.9 ms at 32 rows (gpu_sampling_cost.py). Candidates, each checked
for exactness against the float sort / lax.top_k on the same device, then timed in a fori_loop:
- sort of uint32 order keys (atlasjax.sampling._sort_desc: unsigned order = float order): XLA may
  hand unsigned-key sorts to CUB's radix sort;
- the same with int32 indices as values (a pair sort, for top-20 with ids);
- top_k(20) in chunks of C, then top_k(20) of the chunk winners (exact);
- a radix select (the largest key whose count / mass of keys at or above it reaches a target), B bits
  per pass, as a histogram per pass.
    JAX_PLATFORMS=cuda python notebooks/gpu_sampling_sorts.py   # -> $OUT/sampling_sorts.json
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.sampling import _from_order_key as from_key, _order_key as order_key, _sort_desc as sort_desc_keys

VOCAB = int(os.environ.get("VOCAB", 128256))
ROWS = [int(r) for r in os.environ.get("ROWS", "1,8,32,128").split(",")]
ITERS, K = 20, 20


def sort_desc_float(x):
    return -jnp.sort(-x, axis=-1)


def top_k_pair_sort(x):
    rows, v = x.shape
    keys, ids = jax.lax.sort((order_key(x), jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), x.shape)),
                             dimension=1, num_keys=1)
    return from_key(keys[:, ::-1][:, :K]), ids[:, ::-1][:, :K]


def top_k_chunked(x, chunk):
    rows, v = x.shape
    n = -(-v // chunk)
    xp = jnp.pad(x, ((0, 0), (0, n * chunk - v)), constant_values=-jnp.inf).reshape(rows, n, chunk)
    vals, ids = jax.lax.top_k(xp, K)
    ids = ids + (jnp.arange(n, dtype=jnp.int32) * chunk)[None, :, None]
    best, at = jax.lax.top_k(vals.reshape(rows, n * K), K)
    return best, jnp.take_along_axis(ids.reshape(rows, n * K), at, axis=-1)


def radix_select(keys, weights, target, bits):
    """Per row the largest key T with sum(weights[keys >= T]) >= target."""
    rows = keys.shape[0]
    bins = 1 << bits
    t = jnp.zeros((rows,), jnp.uint32)
    above = jnp.zeros((rows,), jnp.float32)        # weight of keys above every candidate of this pass
    for shift in range(32 - bits, -1, -bits):
        high = shift + bits
        prefix = (keys >> high) if high < 32 else jnp.zeros_like(keys)
        t_prefix = (t >> high) if high < 32 else jnp.zeros_like(t)
        same = prefix == t_prefix[:, None]
        digit = ((keys >> shift) & (bins - 1)).astype(jnp.int32)
        onehot = (digit[:, :, None] == jnp.arange(bins, dtype=jnp.int32)) & same[:, :, None]
        hist = jnp.sum(jnp.where(onehot, weights[:, :, None], 0.0), axis=1)            # [rows, bins]
        at_or_above = above[:, None] + jnp.cumsum(hist[:, ::-1], axis=-1)[:, ::-1]      # per digit d
        ok = at_or_above >= target[:, None]
        d = jnp.maximum(jnp.sum(ok, axis=-1) - 1, 0)
        above = above + jnp.sum(jnp.where(jnp.arange(bins)[None, :] > d[:, None], hist, 0.0), axis=-1)
        t = t | (d.astype(jnp.uint32) << shift)
    return t


def timed(fn, x) -> float:
    def loop(x):
        def body(i, acc):
            out = fn(x + i.astype(jnp.float32) * 1e-6)
            leaves = jax.tree.leaves(out)
            return acc + sum(jnp.sum(leaf[..., :1].astype(jnp.float32)) for leaf in leaves)
        return jax.lax.fori_loop(0, ITERS, body, jnp.float32(0))
    run = jax.jit(loop)
    jax.block_until_ready(run(x))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(run(x))
        best = min(best, (time.perf_counter() - t) / ITERS)
    return best * 1e6


def main():
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "vocab": VOCAB, "rows": {}}
    for rows in ROWS:
        x = jax.random.normal(jax.random.key(rows), (rows, VOCAB), jnp.float32) * 3
        probs = jax.nn.softmax(x, axis=-1)
        keys = order_key(x)
        ones = jnp.ones_like(x)
        # exactness first
        want = np.asarray(sort_desc_float(x))
        checks = {"sort keys == float sort": bool((np.asarray(jax.jit(sort_desc_keys)(x)) == want).all())}
        tv, ti = jax.lax.top_k(x, K)
        pv, pi = jax.jit(top_k_pair_sort)(x)
        checks["pair sort top20 == top_k"] = bool((np.asarray(pv) == np.asarray(tv)).all()
                                                   and (np.asarray(pi) == np.asarray(ti)).all())
        for c in (256, 1024, 4096):
            cv, ci = jax.jit(lambda a, c=c: top_k_chunked(a, c))(x)
            checks[f"chunked {c} == top_k"] = bool((np.asarray(cv) == np.asarray(tv)).all()
                                                   and (np.asarray(ci) == np.asarray(ti)).all())
        for bits in (4, 8):
            kth = jax.jit(lambda k, w, b=bits: radix_select(k, w, jnp.full((rows,), 50.0), b))(keys, ones)
            checks[f"radix{bits} 50th == sort"] = bool((np.asarray(from_key(kth)) == want[:, 49]).all())
            pth = jax.jit(lambda k, w, b=bits: radix_select(k, w, jnp.full((rows,), 0.9), b))(keys, probs)
            sp = np.sort(np.asarray(probs), axis=-1)[:, ::-1]
            n_keep = (np.cumsum(sp, axis=-1) - sp < 0.9).sum(-1)
            checks[f"radix{bits} top-p 0.9 == sort"] = bool((np.asarray(from_key(pth)) == want[np.arange(rows),
                                                                                             n_keep - 1]).all())
        times = {
            "float sort": timed(sort_desc_float, x),
            "uint32 key sort": timed(sort_desc_keys, x),
            "top_k(20)": timed(lambda a: jax.lax.top_k(a, K), x),
            "pair sort top20": timed(top_k_pair_sort, x),
            **{f"chunked top20 C={c}": timed(lambda a, c=c: top_k_chunked(a, c), x) for c in (256, 1024, 4096)},
            **{f"radix{b} top-k threshold": timed(lambda a, b=b: radix_select(order_key(a), jnp.ones_like(a),
                                                                               jnp.full((rows,), 50.0), b), x)
               for b in (4, 8)},
            **{f"radix{b} top-p threshold": timed(lambda a, b=b: radix_select(
                order_key(a), jax.nn.softmax(a, axis=-1), jnp.full((rows,), 0.9), b), x) for b in (4, 8)},
        }
        out["rows"][rows] = {"exact": checks, "us": times}
        print(rows, checks, {k: f"{v:.1f}" for k, v in times.items()}, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "sampling_sorts.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

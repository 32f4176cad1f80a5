"""GPU: residual add + RMSNorm after a row-parallel projection, with XLA's own split-K against an
explicit one (a batched dot over K slices, whose partials XLA can sum inside the norm's fusion).

Prints, per 8B shape (o_proj 4096x4096, down 14336x4096; 8 rows), the CUPTI time of all kernels of
one call, the kernel count of the compiled HLO and the largest difference of the normalized output
from the implicit variant. `dot_only` / `gemm_only_S*` time the projection alone.
  JAX_PLATFORMS=cuda PYTHONPATH=. python notebooks/gpu_explicit_split_k.py
"""
import re

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import device_ms

M, EPS = 8, 1e-5


def rms(v, g):
    v32 = v.astype(jnp.float32)
    return (v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + EPS) * g).astype(jnp.bfloat16)


def partials(x, w, splits):
    """x @ w as `splits` f32 partial products over slices of K: [splits, M, N]."""
    k, n = w.shape
    return jnp.einsum("msk,skn->smn", x.reshape(M, splits, k // splits), w.reshape(splits, k // splits, n),
                      preferred_element_type=jnp.float32)


def implicit(x, w, h, g):   # what the model does now: XLA picks split-K itself
    hn = h + x @ w
    return hn, rms(hn, g)


def dot_only(x, w, h, g):
    return x @ w, h


def explicit(splits):
    def f(x, w, h, g):
        hn = (h.astype(jnp.float32) + partials(x, w, splits).sum(0)).astype(jnp.bfloat16)
        return hn, rms(hn, g)
    return f


def gemm_only(splits):
    return lambda x, w, h, g: (partials(x, w, splits), h)


def kernels(f, *args):
    text = jax.jit(f).lower(*args).compile().as_text()
    return len(re.findall(r"= [^ ]+ (fusion|custom-call)\(", text[text.index("ENTRY"):]))


def main():
    rng = np.random.default_rng(0)
    variants = ([("implicit", implicit, True), ("dot_only", dot_only, False)]
                + [(f"explicit_S{s}", explicit(s), True) for s in (2, 4, 8)]
                + [(f"gemm_only_S{s}", gemm_only(s), False) for s in (2, 8)])
    for k, n in [(4096, 4096), (14336, 4096)]:
        ws = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16) for _ in range(4)]
        x = jnp.asarray(rng.standard_normal((M, k)), jnp.bfloat16)
        h = jnp.asarray(rng.standard_normal((M, n)), jnp.bfloat16)
        g = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
        ref = implicit(x, ws[0], h, g)[1].astype(jnp.float32)
        for name, f, normalizes in variants:
            rotated = jax.jit(lambda x, ws, h, g, f=f: [f(x, w, h, g) for w in ws])   # weights rotate past L2
            us = device_ms(rotated, x, ws, h, g) / len(ws) * 1e3
            diff = float(jnp.max(jnp.abs(f(x, ws[0], h, g)[1].astype(jnp.float32) - ref))) if normalizes else 0.0
            print(f"K={k} N={n} {name:12s} {us:6.1f} us  kernels {kernels(f, x, ws[0], h, g)}  maxdiff {diff:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()

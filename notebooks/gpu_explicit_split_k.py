"""GPU: residual add + RMSNorm after a row-parallel projection, with XLA's own split-K against an
explicit one (a batched dot over K slices, whose partials XLA can sum inside the norm's fusion).

Prints, per 8B shape (o_proj 4096x4096, down 14336x4096; 8 rows), the CUPTI time of all kernels of
one call, the kernel count of the compiled HLO and the largest difference of the normalized output.
  JAX_PLATFORMS=cuda PYTHONPATH=. python notebooks/gpu_explicit_split_k.py
"""
import re, jax, jax.numpy as jnp, numpy as np
from atlasjax.bench_kernels_quant import device_ms
rng = np.random.default_rng(0)
M, EPS = 8, 1e-5
def rms(v, g):
    v32 = v.astype(jnp.float32)
    return (v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + EPS) * g).astype(jnp.bfloat16)
def implicit(x, w, h, g):      # what the model does now: XLA picks split-K itself
    hn = h + (x @ w)
    return hn, rms(hn, g)
def explicit(S):
    def f(x, w, h, g):
        k, n = w.shape
        p = jnp.einsum("msk,skn->smn", x.reshape(M, S, k // S), w.reshape(S, k // S, n), preferred_element_type=jnp.float32)
        hn = (h.astype(jnp.float32) + p.sum(0)).astype(jnp.bfloat16)
        return hn, rms(hn, g)
    return f
def kernels(f, *a):
    txt = jax.jit(f).lower(*a).compile().as_text()
    entry = txt[txt.index("ENTRY"):]
    return len(re.findall(r"= [^ ]+ (fusion|custom-call)\(", entry))
for k, n in [(4096, 4096), (14336, 4096)]:
    ws = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16) for _ in range(4)]
    x = jnp.asarray(rng.standard_normal((M, k)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((M, n)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
    ref = implicit(x, ws[0], h, g)
    def gemm_only(S):
        def f(x, w, h, g):
            k, n = w.shape
            return jnp.einsum("msk,skn->smn", x.reshape(M, S, k // S), w.reshape(S, k // S, n), preferred_element_type=jnp.float32), h
        return f
    def dot_only(x, w, h, g):
        return (x @ w), h
    for name, f in [("implicit", implicit), ("dot_only", dot_only)] + [(f"explicit_S{S}", explicit(S)) for S in (2, 4, 8)] + [(f"gemm_only_S{S}", gemm_only(S)) for S in (2, 8)]:
        rot = jax.jit(lambda x, ws, h, g, f=f: [f(x, w, h, g) for w in ws])
        us = device_ms(rot, x, ws, h, g) / len(ws) * 1e3
        out = f(x, ws[0], h, g)
        err = float(jnp.max(jnp.abs(out[1].astype(jnp.float32) - ref[1].astype(jnp.float32)))) if out[1].shape == ref[1].shape and "only" not in name else 0.0
        print(f"K={k} N={n} {name:12s} {us:6.1f} us  kernels {kernels(f, x, ws[0], h, g)}  maxdiff {err:.3f}", flush=True)

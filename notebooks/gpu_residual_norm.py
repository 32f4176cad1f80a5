"""GPU: a row-parallel projection + residual add + RMSNorm at decode size, as XLA forms it (GEMM
with its own split-K, then add and norm kernels) against an explicit split whose partials a
Pallas kernel (below: one program per row) sums, adds and normalizes in one launch.

Prints, per 8B shape (o_proj 4096x4096, down 14336x4096) and row count, the CUPTI time of all
kernels of one call (weights rotated past the L2), the kernel count, and the largest difference of
both outputs from the XLA variant; then the kernel alone and its error against the jnp reference.
  JAX_PLATFORMS=cuda PYTHONPATH=. python notebooks/gpu_residual_norm.py     [ROWS=8 SPLITS=2,4,8]

Result (session 10, docs/performance.md): the kernel alone takes 2.1-3.3 us, but the explicit
split's GEMM is slower than XLA's own split-K, so the pair loses 1.2-1.5 us per call. Not used.
"""
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from atlasjax.bench_kernels_quant import device_ms

EPS = 1e-5


def split_k_partials(x: jax.Array, w: jax.Array, splits: int) -> jax.Array:
    """x [M, K] @ w [K, N] as `splits` f32 products over equal slices of K: [splits, M, N]."""
    m, k = x.shape
    n = w.shape[1]
    return jnp.einsum("msk,skn->smn", x.reshape(m, splits, k // splits),
                      w.astype(x.dtype).reshape(splits, k // splits, n), preferred_element_type=jnp.float32)


def residual_norm_reference(partials, residual, *, eps):
    """jnp: the unfused model's arithmetic (projection output rounded to the residual's dtype,
    added, rounded; RMSNorm in f32 of the rounded residual)."""
    dtype = residual.dtype
    new = residual + partials.sum(0).astype(dtype)
    nf = new.astype(jnp.float32)
    return new, (nf * lax.rsqrt(jnp.mean(nf * nf, axis=-1, keepdims=True) + eps)).astype(dtype)


def _kernel(p_ref, r_ref, res_out, norm_out, *, eps):
    row = lax.axis_index("rows")
    splits, _, n = p_ref.shape
    dtype = r_ref.dtype

    def body(p_smem, r_smem, res_smem, norm_smem, bar):
        # Whole contiguous rows, in bounds: 1-D bulk copies of any length (a TMA box is <= 256).
        copy = functools.partial(plgpu.copy_gmem_to_smem, barrier=bar.at[0],
                                 oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        for s in range(splits):
            copy(p_ref.at[s, row], p_smem.at[s])
        copy(r_ref.at[row], r_smem)
        plgpu.barrier_wait(bar.at[0])
        proj = p_smem[0]
        for s in range(1, splits):
            proj = proj + p_smem[s]
        new = (r_smem[...].astype(jnp.float32) + proj.astype(dtype).astype(jnp.float32)).astype(dtype)
        nf = new.astype(jnp.float32)
        inv = lax.rsqrt(jnp.sum(nf * nf) * (1.0 / n) + eps)
        res_smem[...] = new
        norm_smem[...] = (nf * inv).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(res_smem, res_out.at[row])
        plgpu.copy_smem_to_gmem(norm_smem, norm_out.at[row])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(body, plgpu.SMEM((splits, n), jnp.float32), plgpu.SMEM((n,), dtype),
                  plgpu.SMEM((n,), dtype), plgpu.SMEM((n,), dtype),
                  plgpu.Barrier(num_arrivals=splits + 1, num_barriers=1))


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def residual_norm_pallas(partials, residual, *, eps, interpret=False):
    _, m, n = partials.shape
    out = jax.ShapeDtypeStruct((m, n), residual.dtype)

    def residual_rmsnorm_kernel(*refs):   # named so profiles are readable
        _kernel(*refs, eps=eps)
    return plgpu.kernel(residual_rmsnorm_kernel, out_type=(out, out), grid=(m,), grid_names=("rows",),
                        interpret=interpret)(partials, residual)



def xla(x, w, h):   # what the model does now: XLA picks split-K itself
    hn = h + (x @ w)
    hf = hn.astype(jnp.float32)
    return hn, (hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + EPS)).astype(hn.dtype)


def fused(splits):
    return lambda x, w, h: residual_norm_pallas(split_k_partials(x, w, splits), h, eps=EPS)


def gemm_only(splits):
    return lambda x, w, h: split_k_partials(x, w, splits)


def kernels(f, *args):
    text = jax.jit(f).lower(*args).compile().as_text()
    return len(re.findall(r"= [^ ]+ (fusion|custom-call)\(", text[text.index("ENTRY"):]))


def main():
    rng = np.random.default_rng(0)
    splits_list = [int(s) for s in os.environ.get("SPLITS", "2,4,8").split(",")]
    rows_list = [int(m) for m in os.environ.get("ROWS", "8,1,32").split(",")]
    for k, n in [(4096, 4096), (14336, 4096)]:
        ws = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16) for _ in range(4)]
        for m in rows_list:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            h = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
            ref = [o.astype(jnp.float32) for o in xla(x, ws[0], h)]
            variants = ([("xla", xla, True)] + [(f"fused_S{s}", fused(s), True) for s in splits_list]
                        + [(f"gemm_only_S{s}", gemm_only(s), False) for s in splits_list])
            for name, f, compare in variants:
                rotated = jax.jit(lambda x, ws, h, f=f: [f(x, w, h) for w in ws])
                us = device_ms(rotated, x, ws, h) / len(ws) * 1e3
                diff = ""
                if compare:
                    got = f(x, ws[0], h)
                    diff = " maxdiff residual %.4f normed %.4f" % tuple(
                        float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) for g, r in zip(got, ref))
                print(f"K={k} N={n} M={m} {name:12s} {us:6.2f} us  kernels {kernels(f, x, ws[0], h)}{diff}",
                      flush=True)
            for s in splits_list:   # the kernel alone, against its jnp reference
                p = split_k_partials(x, ws[0], s)
                us = device_ms(jax.jit(lambda p, h: residual_norm_pallas(p, h, eps=EPS)), p, h) * 1e3
                got = residual_norm_pallas(p, h, eps=EPS)
                want = residual_norm_reference(p, h, eps=EPS)
                err = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w_.astype(jnp.float32))))
                       for g, w_ in zip(got, want)]
                print(f"K={k} N={n} M={m} kernel_S{s}   {us:6.2f} us  vs reference maxdiff {err[0]:.4f} {err[1]:.4f}",
                      flush=True)


if __name__ == "__main__":
    main()

"""GPU: can a Mosaic GPU bf16 decode matmul stream as fast as XLA's GEMM? (session 18)

Session 9 ran plain bf16 weights through the fused dequantize kernel (pallas_kernels/
quantized_matmul.py) and found it 4-6% slower than XLA's GEMM on the Llama-3.1-8B decode shapes,
too slow to absorb the RMSNorm / residual-add / silu kernels around it. That kernel loads each
weight tile into registers (it must, to dequantize) and waits for every wgmma before the next
step. A bf16 weight needs neither: here the tile feeds the wgmma straight from shared memory and
the pipeline keeps `delay` wgmmas in flight (`delay_release`). Variants per shape:
  nN_kK_dD_sS_rR  N weight rows per block (one warpgroup, wgmma M = N), K elements per step,
                  D steps in flight, S K splits (f32 partials summed by XLA), R wgmmas in flight;
  kn              the weight stored [K, N] (XLA's layout), fed as a transposed shared-memory operand;
  stream          the same pipeline with steps that do nothing (the floor of this structure).
Beside them: XLA's dot on W [K, N] (the engine's bf16 path) and on W [N, K].
Times: CUPTI kernel time per call (all kernels of the call, the split sum included), 8 rows,
weights rotated past the L2; "%" is of a device-to-device copy measured in the same run.

MODE=kernel times what came of it, pallas_kernels/decode_matmul.py (the [K, N] layout), over its
configs at 8 rows (CONFIGS=a,b: only those; `_s2`: a 2-block cluster per tile over the halves of K,
session 22) and with its default config at 16-64 rows, against XLA's dot, on the 8B shapes
(SHAPES=a,b: only those), their TP=2 shards and Llama-3.2-1B's.

MODE=prologue times the kernel's fused prologues (session 19) on the 8B shapes they serve, at 8-32
rows: qkv with the input RMSNorm, down with SwiGLU and the residual; each against XLA
computing the same (norm or silu * up, dot, add: all its kernels) and against XLA's norm or
SwiGLU followed by the kernel without a prologue (the session-18 engine).

  JAX_PLATFORMS=cuda PYTHONPATH=. [SHAPES=qkv,down] python notebooks/gpu_bf16_smem_gemv.py   # -> $OUT/bf16_smem_gemv.json
  JAX_PLATFORMS=cuda PYTHONPATH=. MODE=kernel python notebooks/gpu_bf16_smem_gemv.py          # -> $OUT/decode_matmul.json
  JAX_PLATFORMS=cuda PYTHONPATH=. MODE=prologue python notebooks/gpu_bf16_smem_gemv.py        # -> $OUT/decode_prologue.json

The same kernel on per-channel int8 / fp8 weights (session 20): notebooks/gpu_quant_decode_matmul.py.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, copy_bandwidth, device_ms, rotated
from models.deferred import SwiGLU, rms_norm
from pallas_kernels.decode_matmul import decode_matmul
from pallas_kernels.decode_matmul_rules import DecodeMatmulConfig, default_config
from pallas_kernels.gemm_tiling import SMEM_BUDGET, k_splits, swizzled

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
KERNEL_SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "down": (14336, 4096),
                 "o_proj_tp2": (2048, 4096), "down_tp2": (7168, 4096), "qkv_tp2": (4096, 3072),
                 "qkv_1b": (2048, 3072), "o_proj_1b": (2048, 2048), "down_1b": (8192, 2048)}
KERNEL_CONFIGS = {f"k{k}_d{d}_r{r}{'_s2' if s == 2 else ''}":
                  DecodeMatmulConfig(tile_k=k, max_concurrent_steps=d, wgmmas_in_flight=r, k_split=s)
                  for k in (128, 256) for d in (3, 4, 6) for r in (0, 1) for s in (1, 2)}
ROWS = 8


def gemv(k, n, *, tile_n=64, tile_k=128, depth=4, splits=1, delay=1, kn=False, empty=False):
    """A jitted fn(x [8, K] bf16, w) -> y [8, N] bf16; w is [N, K] (or [K, N] with kn)."""
    steps = k // tile_k
    assert steps % splits == 0 and n % tile_n == 0, (k, n, tile_k, splits, tile_n)
    per_split = steps // splits
    out_dtype = jnp.float32 if splits > 1 else jnp.bfloat16

    def kernel(w_gmem, x_gmem, out_gmem, out_smem):
        ni, sp = lax.axis_index("n"), lax.axis_index("split")
        first = sp * per_split
        rows = pl.ds(ni * tile_n, tile_n)
        if kn:
            w_spec = plgpu.BlockSpec((tile_k, tile_n), lambda s: (first + s, 0), delay_release=delay,
                                     transforms=swizzled(tile_n * 16, 16, "weight"))
            w_rows = w_gmem.at[:, rows]
        else:
            w_spec = plgpu.BlockSpec((tile_n, tile_k), lambda s: (0, first + s), delay_release=delay,
                                     transforms=swizzled(tile_k * 16, 16, "weight"))
            w_rows = w_gmem.at[rows]
        x_spec = plgpu.BlockSpec((ROWS, tile_k), lambda s: (0, first + s), delay_release=delay,
                                 transforms=swizzled(tile_k * 16, 16, "x"))

        def body(acc_ref):
            def step(_, w_smem, x_smem):
                if empty:
                    return
                plgpu.wgmma(acc_ref, w_smem.T if kn else w_smem, x_smem.T)
                plgpu.wgmma_wait(delay)

            plgpu.emit_pipeline(step, grid=(per_split,), in_specs=[w_spec, x_spec],
                                max_concurrent_steps=depth)(w_rows, x_gmem)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        acc = pl.run_scoped(body, plgpu.ACC((tile_n, ROWS), jnp.float32))
        out_smem.T[...] = plgpu.layout_cast(acc.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[sp, :, rows])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, ROWS, n), out_dtype),
        scratch_types=[plgpu.SMEM((ROWS, tile_n), out_dtype)],
        grid=(n // tile_n, splits), grid_names=("n", "split"), kernel_name="bf16_smem_gemv",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )

    def fn(x, w):
        y = call(w, x)
        return (y[0] if splits == 1 else y.sum(0)).astype(jnp.bfloat16)
    return fn


def fits(tile_n, tile_k, depth):
    return depth * (tile_n + ROWS) * tile_k * 2 + ROWS * tile_n * 4 <= SMEM_BUDGET


def variants(k, n):
    """name -> gemv kwargs: the auto K split (~2 blocks per SM) around a grid of tile shapes."""
    out = {}
    for tile_n in (64, 128):
        for tile_k in (128, 256):
            steps = k // tile_k
            auto = k_splits(steps, n // tile_n, requested=None, max_auto=max(1, steps // 4))
            for splits in sorted({1, auto, 2 * auto if steps % (2 * auto) == 0 else auto}):
                for depth in (4, 8):
                    for delay in (1,) if (tile_n, depth) != (64, 4) else (0, 1):
                        if depth > delay and fits(tile_n, tile_k, depth) and steps % splits == 0:
                            out[f"n{tile_n}_k{tile_k}_d{depth}_s{splits}_r{delay}"] = dict(
                                tile_n=tile_n, tile_k=tile_k, depth=depth, splits=splits, delay=delay)
    return out


def start() -> float:
    """The copy bandwidth (bytes/s), measured and printed with the device and jax version."""
    copy = copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  copy {copy / 1e9:.0f} GB/s", flush=True)
    return copy


def weight_copies(rng, k, n):
    """A random bf16 weight [k, n] and enough distinct copies of it to rotate past the L2."""
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
    copies = max(2, -(-MIN_ROTATION_BYTES // w.nbytes))
    return w, [w + i for i in range(copies)]


def time_paths(label, kernels, x, w, ws, ref, row, copy):
    """Into row: each path's relative-norm error against ref and its time per weight (us, median
    CUPTI time of one call over the rotated copies ws); a path that does not lower is reported and
    skipped. Prints the row's times with their share of copy bandwidth (row["bytes"])."""
    for key, fn in kernels.items():
        try:
            y = np.asarray(jax.jit(fn)(x, w), np.float32)
            row[f"{key}_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
            row[f"{key}_us"] = device_ms(rotated(fn), x, ws) / len(ws) * 1e3
        except Exception as e:  # noqa: BLE001 - a config that does not lower is reported
            print(f"{label} {key}: failed: {str(e).splitlines()[0][:300]}", flush=True)
    print(f"{label}: " + ", ".join(
        f"{key[:-3]} {v:.2f} us ({row['bytes'] / (v * 1e-6) / copy:.1%}, err {row[key[:-3] + '_err']:.1e})"
        for key, v in row.items() if key.endswith("_us")), flush=True)


def write(name, copy, results):
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump(dict(copy_bytes_per_s=copy, device=jax.devices()[0].device_kind, jax=jax.__version__,
                       results=results), f, indent=1)


def default_name(n):
    c = default_config(n)
    return f"k{c.tile_k}_d{c.max_concurrent_steps}_r{c.wgmmas_in_flight}"


def kernel_main():
    """MODE=kernel: pallas_kernels/decode_matmul.py against XLA's dot."""
    copy = start()
    results = []
    rng = np.random.default_rng(0)
    for name, (k, n) in KERNEL_SHAPES.items():
        if name not in os.environ.get("SHAPES", name).split(","):
            continue
        w, ws = weight_copies(rng, k, n)
        copies = len(ws)
        for rows in (8, 16, 32):   # MAX_ROWS
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
            ref = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32))
            chosen = os.environ.get("CONFIGS")   # a comma list of KERNEL_CONFIGS names, default all
            swept = {c: KERNEL_CONFIGS[c] for c in chosen.split(",")} if chosen else KERNEL_CONFIGS
            configs = swept | {"default": None} if rows == 8 else {"default": None}   # None: default_config(N)
            row = dict(proj=name, K=k, N=n, rows=rows)
            row["xla_us"] = device_ms(rotated(lambda x, w: x @ w), x, ws) / copies * 1e3
            for cname, cfg in configs.items():
                fn = lambda x, w, cfg=cfg: decode_matmul(x, w, config=cfg)   # noqa: E731
                y = np.asarray(fn(x, ws[0]), np.float32)
                row[f"{cname}_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                row[f"{cname}_us"] = device_ms(rotated(fn), x, ws) / copies * 1e3
            best = min((key for key in row if key.endswith("_us") and key != "xla_us"), key=row.get)
            row["best"] = best
            print(f"{name} {k}x{n} rows {rows}: XLA {row['xla_us']:.2f} us; best {best} {row[best]:.2f} us "
                  f"({row[best] / row['xla_us']:.3f}x, {w.nbytes / (row[best] * 1e-6) / copy:.1%} of copy); "
                  + (f"default ({default_name(n)}) {row['default_us']:.2f}" if rows == 8 else ""), flush=True)
            results.append(row)
        del ws
        write("decode_matmul.json", copy, results)


def prologue_main():
    """MODE=prologue: the kernel's RMSNorm (qkv) and SwiGLU (down) prologues against XLA."""
    copy = start()
    rng = np.random.default_rng(0)
    results = []
    for name, (k, n), swiglu in (("qkv+norm", KERNEL_SHAPES["qkv"], False), ("down+swiglu", KERNEL_SHAPES["down"], True)):
        w, ws = weight_copies(rng, k, n)
        copies = len(ws)
        scale = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
        for rows in (8, 16, 32):
            x = jnp.asarray(rng.standard_normal((rows, 2 * k if swiglu else k), np.float32), jnp.bfloat16)
            r = jnp.asarray(rng.standard_normal((rows, n), np.float32), jnp.bfloat16) if swiglu else None
            act = (lambda x: SwiGLU(x).materialize()) if swiglu else (lambda x: rms_norm(x, scale, 1e-5))
            fused_kw = dict(swiglu=True) if swiglu else dict(norm_scale=scale, norm_eps=1e-5)
            add = (lambda y: y + r) if swiglu else (lambda y: y)
            xs = [x + i for i in range(copies)]   # an x per weight copy: XLA may not share one norm / SwiGLU

            def timed(fn, xs=xs, ws=ws):
                return device_ms(jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)]), xs, ws) / copies * 1e3
            row = dict(proj=name, K=k, N=n, rows=rows)
            row["xla_us"] = timed(lambda x, w: add(act(x) @ w))
            row["xla_act_kernel_us"] = timed(lambda x, w: decode_matmul(act(x), w, r))
            ref = np.asarray(add(act(x) @ w), np.float32)
            split = () if not swiglu else ("k256_d4_r0_s2", "k256_d4_r1_s2")   # the norm needs all of K in one block
            for cname, cfg in {"default": None, **{c: KERNEL_CONFIGS[c] for c in ("k128_d4_r0", "k256_d4_r0", "k256_d4_r1", *split)}}.items():
                fn = lambda x, w, cfg=cfg: decode_matmul(x, w, r, config=cfg, **fused_kw)   # noqa: E731
                y = np.asarray(fn(x, ws[0]), np.float32)
                row[f"{cname}_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                row[f"{cname}_us"] = timed(fn)
            print(f"{name} {k}x{n} rows {rows}: " + ", ".join(f"{key[:-3]} {v:.2f}" for key, v in row.items()
                                                               if key.endswith("_us")) + f"; default err {row['default_err']:.1e}", flush=True)
            results.append(row)
        del ws
    write("decode_prologue.json", copy, results)


def main():
    if os.environ.get("MODE") == "kernel":
        return kernel_main()
    if os.environ.get("MODE") == "prologue":
        return prologue_main()
    copy = start()
    names = os.environ.get("SHAPES", ",".join(SHAPES)).split(",")
    results = []
    rng = np.random.default_rng(0)
    for name in names:
        k, n = SHAPES[name]
        w, ws_kn = weight_copies(rng, k, n)
        copies = len(ws_kn)
        x = jnp.asarray(rng.standard_normal((ROWS, k), np.float32), jnp.bfloat16)
        ref = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32))
        ws_nk = [jnp.asarray(v.T) for v in ws_kn]

        def timed(variant, fn, ws, **info):
            try:
                y = np.asarray(fn(x, ws[0]), np.float32)
                err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) if not info.get("empty") else None
                us = device_ms(rotated(fn), x, ws) / copies * 1e3
            except Exception as e:  # noqa: BLE001 - a variant that does not lower is reported, not fatal
                print(f"{name} {variant}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                return None
            frac = w.nbytes / (us * 1e-6) / copy
            results.append(dict(proj=name, K=k, N=n, variant=variant, us=us, copy_fraction=frac, err=err, **info))
            print(f"{name} {variant}: {us:.2f} us ({frac:.1%} of copy) err {err}", flush=True)
            return us

        xla = timed("xla_KN", jax.jit(lambda x, w: x @ w), ws_kn)
        timed("xla_NK", jax.jit(lambda x, w: lax.dot_general(x, w, (((1,), (1,)), ((), ())))), ws_nk)
        best = (None, float("inf"), None)
        for vname, kw in variants(k, n).items():
            us = timed(vname, gemv(k, n, **kw), ws_nk, **kw)
            if us is not None and us < best[1]:
                best = (vname, us, kw)
        if best[2] is not None:
            kw = dict(best[2])
            timed(f"{best[0]}_kn", gemv(k, n, kn=True, **kw), ws_kn, kn=True, **kw)
            timed(f"{best[0]}_stream", gemv(k, n, empty=True, **kw), ws_nk, empty=True, **kw)
            print(f"== {name}: best {best[0]} {best[1]:.2f} us against XLA {xla:.2f} us "
                  f"({best[1] / xla:.3f}x)", flush=True)
        del ws_kn, ws_nk
        write("bf16_smem_gemv.json", copy, results)


if __name__ == "__main__":
    main()

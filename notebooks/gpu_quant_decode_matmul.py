"""GPU: the decode matmul (pallas_kernels/decode_matmul.py) on per-channel int8 / fp8 weights (session 20).

The bf16 kernel took the input RMSNorm, SwiGLU and residual adds out of the bf16 step (sessions
18-19, notebooks/gpu_bf16_smem_gemv.py). Quantized steps could take them too if the kernel streamed
int8 / fp8 weights (stored [N, K], each tile converted to bf16 in registers or staged in shared
memory: `stage_weight`) as fast as XLA's convert-fused GEMM, the engine's path for them.

MODE=quant (default) times the kernel against XLA's GEMM, for each of FORMATS (default
int8,int8mma,fp8; int8mma: int8 stored in mma order, session 21, pallas_kernels/int8_mma_order.py):
over its configs at 8 rows for the formats in SWEEP (default int8mma; CONFIGS=a,b: only those;
`_s2`: a 2-block cluster per tile over the halves of K, session 22; `_t`: only the tiles past the
last full wave of blocks split that way, session 24), with the default (and the
swept best) at 1-32 rows (ROW_COUNTS=8,1,16,32); then with its prologues and residual against XLA
computing the same (qkv, gate_up, lm_head: norm; o_proj: residual; down: SwiGLU and residual).

MODE=probe splits the kernel's step into variants to find where its time goes (`int8_gemv`: the
empty stream, the tile's conversion alone, register or shared-memory A, an explicit
WGMMA_UPCAST_2X load, a bf16 tile; `int8_gemv_ws`: 2-4 compute warpgroups, warp-specialized).

  JAX_PLATFORMS=cuda PYTHONPATH=. python notebooks/gpu_quant_decode_matmul.py                  # -> $OUT/decode_quant.json
  JAX_PLATFORMS=cuda PYTHONPATH=. MODE=probe [VARIANTS=empty,inferred] [WS=2:256:4] [SHAPES=o_proj] \
      [FORMATS=int8] python notebooks/gpu_quant_decode_matmul.py                                # -> $OUT/int8_probe.json
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, device_ms, rotated
from atlasjax.quantization import quantize
from gpu_bf16_smem_gemv import ROWS, start, write   # the copy-bandwidth header and JSON write they share
from models.deferred import SwiGLU, rms_norm
from pallas_kernels.decode_matmul import decode_matmul
from pallas_kernels.decode_matmul_rules import DecodeMatmulConfig, default_config
from pallas_kernels.gemm_tiling import interpret_params, num_sms, swizzled
from pallas_kernels.quant_format import codes_as_bf16, with_mma_order
from pallas_kernels.quantized_matmul import quantized_matmul

QUANT_SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "down": (14336, 4096)}
# MODE=quant SHAPES=gate_up,lm_head: wider than `pays`' tiles (448 and 2004); both follow an RMSNorm
WIDE_SHAPES = {"gate_up": (4096, 28672), "lm_head": (4096, 128256)}
QUANT_CONFIGS = {f"k{k}_d{d}_r{r}{'_st' if st else ''}{'_s2' if s == 2 else ''}": DecodeMatmulConfig(k, d, r, st, s)
                 for k in (128, 256, 512) for d in (4, 6) for r in (0, 1) for st in (False, True) for s in (1, 2)}
# `_t`: the tiles past the last full wave of blocks split over K (`tail_split_sms`, session 24)
QUANT_CONFIGS |= {f"k{k}_d{d}_r{r}_t": DecodeMatmulConfig(k, d, r, False, 2, num_sms())
                  for k in (256, 512) for d in (4, 6) for r in (0, 1)}


def quant_main():
    """MODE=quant: the kernel on per-channel int8 / fp8 weights against XLA's convert-fused GEMM."""
    copy = start()
    rng = np.random.default_rng(0)
    results = []
    for name in os.environ.get("SHAPES", ",".join(QUANT_SHAPES)).split(","):
        k, n = QUANT_SHAPES[name] if name in QUANT_SHAPES else WIDE_SHAPES[name]
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.float32)
        for fmt in os.environ.get("FORMATS", "int8,int8mma,fp8").split(","):
            best = None   # the fastest swept config at 8 rows, also timed at other row counts
            mma = fmt == "int8mma"
            qw = with_mma_order(quantize(w, "int8")) if mma else quantize(w, fmt)
            swept = {key: c for key, c in QUANT_CONFIGS.items()   # staged / 128-row steps: slower for int8mma
                     if not (mma and (c.stage_weight or c.tile_k == 128))
                     and (c.k_split == 1 or n // 64 <= 64 or "CONFIGS" in os.environ)   # a K split (session 22): 64-tile weights, or asked for
                     and key in os.environ.get("CONFIGS", key).split(",")}
            copies = max(2, -(-MIN_ROTATION_BYTES // qw.qweight.nbytes))
            qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]

            def timed(fn, x, *, per_weight_x=False):
                if per_weight_x:   # an x per weight copy: XLA may not share one norm / SwiGLU
                    xs = [x + i for i in range(copies)]
                    f = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
                    return device_ms(f, xs, qws) / copies * 1e3
                return device_ms(rotated(fn), x, qws) / copies * 1e3

            for rows in map(int, os.environ.get("ROW_COUNTS", "8,1,16,32").split(",")):
                x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
                ref = np.asarray(quantized_matmul(x, qw, backend="reference"), np.float32)
                row = dict(proj=name, fmt=fmt, K=k, N=n, rows=rows)
                row["xla_us"] = timed(lambda x, w: quantized_matmul(x, w), x)
                sweep = rows == 8 and fmt in os.environ.get("SWEEP", "int8mma").split(",")
                configs = (swept if sweep else
                           {"default": None} | ({best: swept[best]} if best else {}))
                for cname, cfg in configs.items():
                    fn = lambda x, w, cfg=cfg: decode_matmul(x, w, config=cfg)   # noqa: E731
                    try:
                        y = np.asarray(fn(x, qw), np.float32)
                    except Exception as e:  # noqa: BLE001 - a config that does not lower is reported
                        print(f"{name} {fmt} {cname}: failed: {str(e).splitlines()[0][:160]}", flush=True)
                        continue
                    row[f"{cname}_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    row[f"{cname}_us"] = timed(fn, x)
                fastest = min((key for key in row if key.endswith("_us") and key != "xla_us"), key=row.get)
                if sweep:
                    best = fastest[:-3]
                print(f"{name} {fmt} {k}x{n} rows {rows}: XLA {row['xla_us']:.2f} us; best {fastest} "
                      f"{row[fastest]:.2f} us ({row[fastest] / row['xla_us']:.3f}x, "
                      f"{qw.qweight.nbytes / (row[fastest] * 1e-6) / copy:.1%} of copy); default "
                      f"{row.get('default_us', float('nan')):.2f}; err {row[fastest[:-3] + '_err']:.1e}", flush=True)
                results.append(row)
            # the prologue and the residual, at 8 rows, against XLA computing the same: qkv with the
            # input RMSNorm, o_proj with the residual add, down with SwiGLU and the residual add
            if name in ("qkv", "o_proj", "down", "gate_up", "lm_head"):
                swiglu, norm = name == "down", name in ("qkv", "gate_up", "lm_head")
                out_dtype = jnp.float32 if name == "lm_head" else jnp.bfloat16   # the engine's f32 logits
                rows = 8
                scale = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
                x = jnp.asarray(rng.standard_normal((rows, 2 * k if swiglu else k), np.float32), jnp.bfloat16)
                r = None if norm else jnp.asarray(rng.standard_normal((rows, n), np.float32), jnp.bfloat16)
                act = ((lambda x: SwiGLU(x).materialize()) if swiglu else (lambda x: rms_norm(x, scale, 1e-5))
                       if norm else (lambda x: x))
                fused_kw = dict(swiglu=True) if swiglu else dict(norm_scale=scale, norm_eps=1e-5) if norm else {}
                add = (lambda y: y) if norm else (lambda y: y + r)
                row = dict(proj=f"{name}+{'swiglu' if swiglu else 'norm' if norm else 'residual'}", fmt=fmt, K=k, N=n, rows=rows)
                row["xla_us"] = timed(lambda x, w: add(quantized_matmul(act(x), w, out_dtype=out_dtype)), x,
                                      per_weight_x=True)
                row["xla_act_kernel_us"] = timed(lambda x, w: decode_matmul(act(x), w, r, out_dtype=out_dtype), x,
                                                 per_weight_x=True)
                ref = np.asarray(add(quantized_matmul(act(x), qw, out_dtype=out_dtype)), np.float32)
                for cname, cfg in ({"default": None} | ({best: swept[best]} if best else {})).items():
                    effective = cfg or default_config(n, w_dtype=qw.qweight.dtype, k=k)
                    if norm and (effective.tile_k > 256 or effective.k_split > 1):
                        continue   # the norm scale's TMA box holds at most 256 elements; the norm needs all of K
                    fn = lambda x, w, cfg=cfg: decode_matmul(x, w, r, config=cfg, out_dtype=out_dtype, **fused_kw)   # noqa: E731
                    y = np.asarray(fn(x, qw), np.float32)
                    row[f"{cname}_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    row[f"{cname}_us"] = timed(fn, x, per_weight_x=True)
                print(f"{row['proj']} {fmt}: " + ", ".join(f"{key[:-3]} {v:.2f}" for key, v in row.items()
                                                          if key.endswith("_us")) + f"; default err {row.get('default_err', float('nan')):.1e}", flush=True)
                results.append(row)
            write("decode_quant.json", copy, results)


def int8_gemv(k, n, *, tile_k=256, depth=4, in_flight=1, variant="inferred", fmt=jnp.int8):
    """MODE=probe: where the per-channel int8 kernel's step time goes. fn(x [8, K] bf16, w [N, K]
    int8 / e4m3 (bf16 for "bf16_smem")) -> y [8, N] f32 (no channel scale). Variants of the step:
      empty       the pipeline alone (the stream's floor);
      inferred    w_smem[...].astype(bf16) into a register-A wgmma (Mosaic infers the load layout);
      upcast      loaded in WGMMA_UPCAST_2X (32-bit loads), relaid to WGMMA, converted, register A;
      upcast_st   the same, staged in shared memory for a shared-memory-A wgmma;
      convert_st  converted and staged, no wgmma (what the conversion costs);
      bf16_smem   a bf16 weight tile straight from shared memory (no conversion)."""
    w_bits = 16 if variant == "bf16_smem" else 8

    def to_bf16(w_smem):
        if variant == "inferred":
            return codes_as_bf16(w_smem[...])
        return codes_as_bf16(plgpu.layout_cast(plgpu.load(w_smem, layout=plgpu.Layout.WGMMA_UPCAST_2X), plgpu.Layout.WGMMA))

    def kernel(w_gmem, x_gmem, out_gmem, out_smem, staged_smem):
        rows = pl.ds(lax.axis_index("n") * 64, 64)
        w_spec = plgpu.BlockSpec((64, tile_k), lambda s: (0, s), delay_release=in_flight if variant == "bf16_smem" else 0,
                                 transforms=swizzled(tile_k * w_bits, w_bits, "weight"))
        x_spec = plgpu.BlockSpec((ROWS, tile_k), lambda s: (0, s), delay_release=in_flight,
                                 transforms=swizzled(tile_k * 16, 16, "x"))

        def body(acc_ref):
            def step(idx, w_smem, x_smem):
                if variant == "empty":
                    return
                buf = staged_smem.at[idx[0] % (in_flight + 1) if in_flight else 0]
                if variant == "bf16_smem":
                    a = w_smem
                elif variant in ("upcast_st", "convert_st"):
                    buf[...] = to_bf16(w_smem)
                    plgpu.commit_smem()
                    a = buf
                else:
                    a = to_bf16(w_smem)
                if variant != "convert_st":
                    plgpu.wgmma(acc_ref, a, x_smem.T)
                    plgpu.wgmma_wait(in_flight)

            plgpu.emit_pipeline(step, grid=(k // tile_k,), in_specs=[w_spec, x_spec],
                                max_concurrent_steps=depth)(w_gmem.at[rows], x_gmem)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        acc = pl.run_scoped(body, plgpu.ACC((64, ROWS), jnp.float32))
        out_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[:, rows])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((ROWS, n), jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, 64), jnp.float32),
                       plgpu.SMEM((in_flight + 1, 64, tile_k), jnp.bfloat16, transforms=swizzled(tile_k * 16, 16, "a"))],
        grid=(n // 64,), grid_names=("n",), kernel_name=f"int8_probe_{variant}",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def int8_gemv_ws(k, n, *, tile_k=256, depth=4, wgs=2, interpret=False):
    """MODE=probe, variant ws{wgs}: a warp-specialized pipeline (one memory warpgroup issuing the
    TMA copies) whose `wgs` compute warpgroups each convert and multiply 1/wgs of every weight tile's
    K columns into an accumulator of their own; at the end warpgroups 1.. add theirs into warpgroup
    0's through shared memory. More warps per SM to hide the conversion's latency, one kernel."""
    part = tile_k // wgs

    def kernel(w_gmem, x_gmem, out_gmem, out_smem, red_smem, red_barrier, a_smem):
        rows = pl.ds(lax.axis_index("n") * 64, 64)
        wg = lax.axis_index("wg")
        cols = pl.ds(wg * part, part)

        def step(_, w_smem, x_smem, acc_ref):
            a = codes_as_bf16(plgpu.layout_cast(
                plgpu.load(w_smem.at[:, cols], layout=plgpu.Layout.WGMMA_UPCAST_2X), plgpu.Layout.WGMMA))
            if interpret:   # interpret mode's wgmma reads shared memory only
                a_smem.at[wg][...] = a
                plgpu.commit_smem()
                a = a_smem.at[wg]
            plgpu.wgmma(acc_ref, a, x_smem.at[:, cols].T)
            plgpu.wgmma_wait(0)
            return acc_ref

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((64, ROWS), jnp.float32))
            def _(acc_ref):
                eval_pipeline(acc_ref)
                acc = acc_ref[...]
                for i in range(1, wgs):   # warpgroup i hands its sum to warpgroup 0
                    @pl.when(wg == i)
                    def _():
                        red_smem.at[i - 1][...] = acc
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(red_barrier.at[i - 1])

                @pl.when(wg == 0)
                def _():
                    total = acc
                    for i in range(1, wgs):
                        plgpu.barrier_wait(red_barrier.at[i - 1])
                        total = total + plgpu.load(red_smem.at[i - 1], layout=plgpu.Layout.WGMMA)
                    out_smem.T[...] = plgpu.layout_cast(total, plgpu.Layout.WGMMA_TRANSPOSED)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[:, rows])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(k // tile_k,), memory_registers=40, max_concurrent_steps=depth,
            in_specs=[plgpu.BlockSpec((64, tile_k), lambda s: (0, s), transforms=swizzled(tile_k * 8, 8, "weight")),
                      plgpu.BlockSpec((ROWS, tile_k), lambda s: (0, s), transforms=swizzled(tile_k * 16, 16, "x"))],
            wg_axis="wg", num_compute_wgs=wgs, compute_context=compute_context,
        )(w_gmem.at[rows], x_gmem)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((ROWS, n), jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, 64), jnp.float32), plgpu.SMEM((wgs - 1, 64, ROWS), jnp.float32),
                       plgpu.Barrier(num_arrivals=1, num_barriers=wgs - 1),
                       plgpu.SMEM((wgs, 64, part), jnp.bfloat16, transforms=swizzled(part * 16, 16, "a"))],
        grid=(n // 64,), grid_names=("n",), num_threads=wgs + 1, thread_name="wg",
        kernel_name=f"int8_probe_ws{wgs}", interpret=interpret_params(interpret),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def probe_main():
    """MODE=probe: the step variants of `int8_gemv` on the 8B decode shapes, against XLA."""
    copy = start()
    rng = np.random.default_rng(0)
    results = []
    for name in os.environ.get("SHAPES", ",".join(QUANT_SHAPES)).split(","):
        k, n = QUANT_SHAPES[name]
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.float32)
        x = jnp.asarray(rng.standard_normal((ROWS, k), np.float32), jnp.bfloat16)
        for fmt in os.environ.get("FORMATS", "int8,fp8").split(","):
            qw = quantize(w, fmt)
            copies = max(2, -(-MIN_ROTATION_BYTES // qw.qweight.nbytes))
            qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), qw.qweight.T.astype(jnp.float32)))
            row = dict(proj=name, fmt=fmt, K=k, N=n, rows=ROWS)
            row["xla_us"] = device_ms(rotated(lambda x, w: quantized_matmul(x, w)), x, qws) / copies * 1e3
            bf16_ws = []
            for variant in filter(None, os.environ.get("VARIANTS", "empty,inferred,upcast,upcast_st,convert_st,bf16_smem").split(",")):
                if variant == "bf16_smem" and fmt == "fp8":
                    continue
                for tile_k, in_flight in ((128, 1), (256, 1), (256, 0)):
                    key = f"{variant}_k{tile_k}_r{in_flight}"
                    try:
                        f = int8_gemv(k, n, tile_k=tile_k, in_flight=in_flight, variant=variant)
                        ws = [q.qweight for q in qws]
                        if variant == "bf16_smem":   # the same bytes per step as int8 at twice tile_k
                            bf16_ws = bf16_ws or [jnp.asarray(q.qweight, jnp.bfloat16) for q in qws[:max(2, copies // 2)]]
                            ws = bf16_ws
                        if variant not in ("empty", "convert_st"):
                            y = np.asarray(f(ws[0], x), np.float32)
                            row[f"{key}_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                        row[f"{key}_us"] = device_ms(jax.jit(lambda x, ws: [f(w, x) for w in ws]), x, ws) / len(ws) * 1e3
                    except Exception as e:  # noqa: BLE001 - a variant that does not lower is reported
                        print(f"{name} {fmt} {key}: failed: {str(e).splitlines()[0][:200]}", flush=True)
            ws_configs = [tuple(map(int, c.split(":"))) for c in os.environ.get("WS", "2:256:4,2:256:6,2:512:4,4:512:4").split(",") if c]
            for wgs, tile_k, depth in ws_configs:
                key = f"ws{wgs}_k{tile_k}_d{depth}"
                try:
                    f = int8_gemv_ws(k, n, tile_k=tile_k, depth=depth, wgs=wgs)
                    ws = [q.qweight for q in qws]
                    y = np.asarray(f(ws[0], x), np.float32)
                    row[f"{key}_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    row[f"{key}_us"] = device_ms(jax.jit(lambda x, ws: [f(w, x) for w in ws]), x, ws) / len(ws) * 1e3
                except Exception as e:  # noqa: BLE001 - a variant that does not lower is reported
                    print(f"{name} {fmt} {key}: failed: {str(e).splitlines()[0][:300]}", flush=True)
            print(f"{name} {fmt}: " + ", ".join(f"{key[:-3]} {v:.1f}" for key, v in row.items() if key.endswith("_us")), flush=True)
            print(f"{name} {fmt} errors: " + ", ".join(f"{key[:-4]} {v:.1e}" for key, v in row.items() if key.endswith("_err")), flush=True)
            results.append(row)
            write("int8_probe.json", copy, results)


def main():
    return probe_main() if os.environ.get("MODE") == "probe" else quant_main()


if __name__ == "__main__":
    main()

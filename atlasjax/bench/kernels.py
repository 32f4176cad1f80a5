"""`kernels` mode: the device ceilings, then the kernel benchmarks that ship with atlasjax.

Always: device-to-device copy bandwidth and the large-matmul rate (bf16 on GPU, f32 on CPU), plus
model-shaped dense matmuls of the chosen preset (the decode GEMVs at --batch-size and one prefill
GEMM) against those ceilings. On a GPU, when importable: the paged-attention kernels
(`atlasjax.bench_kernels_attention`) and the fused dequantize-matmul kernels
(`atlasjax.bench_kernels_quant`); their rows are kept as they report them, and a failing or
missing benchmark is recorded as such rather than stopping the run.
"""
from __future__ import annotations

import importlib
import traceback

from atlasjax.bench import roofline
from atlasjax.bench.presets import PRESETS, progress
from atlasjax.bench.report import fmt, si, table


def add_args(p) -> None:
    g = p.add_argument_group("kernels")
    g.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS), help="shapes of the dense matmuls")
    g.add_argument("--batch-size", type=int, default=1, help="rows of the decode matmuls")
    g.add_argument("--prefill-tokens", type=int, default=2048)
    g.add_argument("--quick", action="store_true", help="fewer kernel cases")
    g.add_argument("--skip", action="append", default=[], choices=["attention", "quant"])


def _dense(preset: str, batch: int, prefill: int, ceilings: dict) -> list[dict]:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    cfg = PRESETS[preset]
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    item = jnp.dtype(dtype).itemsize
    d, hd = cfg.hidden_size, cfg.head_dim
    shapes = {"qkv_proj": (d, hd * (cfg.num_heads + 2 * cfg.num_kv_heads)), "o_proj": (hd * cfg.num_heads, d),
              "gate_up_proj": (d, 2 * cfg.intermediate_size), "down_proj": (cfg.intermediate_size, d),
              "lm_head": (d, cfg.vocab_size)}
    rows = []
    for m in (batch, prefill):
        for name, (k, n) in shapes.items():
            if on_cpu and k * n * m > 2e9:      # keep the CPU run short
                continue
            # Several weight copies so the cache never holds the weight between calls.
            copies = min(32, -(-(256 << 20) // (k * n * item))) if m == batch and not on_cpu else 1
            keys = jax.random.split(jax.random.key(k + n), copies + 1)
            x = jax.random.normal(keys[0], (m, k), dtype)
            ws = [jax.random.normal(kk, (k, n), dtype) for kk in keys[1:]]
            fn = jax.jit(lambda x, ws: [x @ w for w in ws])
            t = roofline.time_fn(fn, x, ws, iters=3 if on_cpu else 10, reps=3) / copies
            cost = dict(weight_bytes=k * n * item, kv_bytes=0, bytes=(k * n + m * k + m * n) * item,
                        flops=2.0 * m * k * n)
            rows.append(dict(case=f"{name} M={m} K={k} N={n}", **roofline.achieved(cost, t, ceilings)))
            del ws
    return rows


def _attention(quick: bool, ceilings: dict) -> list[dict]:
    mod = importlib.import_module("atlasjax.bench_kernels_attention")
    bw, mm = ceilings["copy_bandwidth_Bps"], ceilings["matmul_flops_per_s"]
    rows: list[dict] = []
    mod.bench_decode(32, 4096, 16, bw, rows, baselines=not quick)
    if not quick:
        mod.bench_decode(1, 32768, 16, bw, rows, baselines=False)
    mod.bench_prefill(4096, mm, rows, with_reference=not quick)
    if not quick:   # the decode step's K/V write, fused (what the engine runs) vs scatter first
        for num_seqs in (1, 128):
            mod.bench_decode_write(num_seqs, 256, rows)
    return rows


def _quant(quick: bool) -> list[dict]:
    mod = importlib.import_module("atlasjax.bench_kernels_quant")
    results = {"decode": [], "prefill": []}
    configs = {"engine": None, "pallas": mod.QuantMatmulConfig()}   # what the engine runs, and the kernel
    for k, n in mod.DECODE_SHAPES[:1] if quick else mod.DECODE_SHAPES:
        mod.bench_decode(k, n, mod.DECODE_ROWS, results, configs)
    if not quick:
        mod.bench_prefill(4096, 6144, 2048, results)
    return results["decode"] + results["prefill"]


def run(args, ceilings: dict) -> tuple[dict, list[str]]:
    import jax  # noqa: PLC0415
    progress("dense matmuls of the preset's shapes")
    results = dict(dense=_dense(args.preset, args.batch_size, args.prefill_tokens, ceilings))
    on_gpu = jax.default_backend() == "gpu"
    for name, fn in (("attention", lambda: _attention(args.quick, ceilings)), ("quant", lambda: _quant(args.quick))):
        if name in args.skip:
            results[name] = dict(skipped="--skip")
        elif not on_gpu:
            results[name] = dict(skipped="needs a GPU (Pallas Mosaic GPU kernels)")
        else:
            progress(f"{name} kernel benchmarks")
            try:
                results[name] = fn()
            except Exception as e:  # noqa: BLE001 - a missing or broken benchmark is a result
                results[name] = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
    report = dict(mode="kernels", settings=dict(preset=args.preset, batch_size=args.batch_size,
                                                 prefill_tokens=args.prefill_tokens, quick=args.quick),
                  results=results, roofline=dict(ceilings=ceilings))
    return report, _tables(results, ceilings)


def _tables(results, ceilings) -> list[str]:
    out = [table("device ceilings (measured)", ["figure", "value"],
                 [[f"copy bandwidth ({ceilings['copy_method']})", si(ceilings["copy_bandwidth_Bps"], "B/s")],
                  [f"{ceilings['matmul_dtype']} matmul {ceilings['matmul_n']}^3",
                   si(ceilings["matmul_flops_per_s"], "FLOP/s")]])]
    out.append(table("dense matmuls (XLA)", ["case", "us", "GB/s", "% copy", "TFLOP/s", "% matmul"],
                     [[r["case"], fmt(r["seconds"], "", 1e6), fmt(r["bytes_per_s"], "", 1e-9),
                       fmt(r["frac_copy_bandwidth"], "", 100), fmt(r["flops_per_s"], "", 1e-12),
                       fmt(r["frac_matmul_rate"], "", 100)] for r in results["dense"]]))
    for name in ("attention", "quant"):
        r = results[name]
        if isinstance(r, dict):
            out.append(f"== {name} kernels ==\n{r.get('skipped') or r.get('error')}")
            continue
        lines = [f"== {name} kernels =="]
        for row in r:
            lines.append("  ".join(f"{k}={_short(v)}" for k, v in row.items()))
        out.append("\n".join(lines))
    return out


def _short(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in v.items()) + "}"
    return str(v)

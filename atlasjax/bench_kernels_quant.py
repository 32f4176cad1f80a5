"""GPU benchmark of the fused dequantize-matmul kernels: `python -m atlasjax.bench_kernels_quant`.

Decode (`--rows`, default 8: the engine's decode step on a GPU) on Llama-3.1-8B projection shapes,
for what the engine runs ("engine": XLA's GEMM for per-channel int8/fp8, the fused kernel for
groups) and the Pallas kernel itself: achieved bytes/s against a device-to-device copy measured in
the same run, and time against the bf16 XLA dot; prefill (M=2048): fused kernel and
dequantize + XLA dot against the bf16 XLA dot. Kernel times come from CUPTI
(`jax.experimental.mosaic.gpu.profiler.measure`, sum of all kernels of one call, median of
iterations). Several weight copies are rotated so the 50 MB L2 never holds the weight.
Writes a JSON of every number to $OUT (or the working directory) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from atlasjax.gguf_blocks import like_gguf
from atlasjax.quantization import dequantize, quantize
from atlasjax.weights_summary import weight_nbytes
from pallas_kernels import rows_matmul as rows_kernel
from pallas_kernels.quant_format import is_per_channel, with_float_offsets
from pallas_kernels.quantized_matmul import QuantMatmulConfig, dequantized_dot, quantized_matmul, xla_convert_matmul

DECODE_SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096), (4096, 128256)]  # (K, N)
# (format, group size, zeros): "sym", "zp" (integer zero points: what int4 quantizes to at load) or
# "offsets" (float offsets: GGUF Q4_1's form, and int4 checkpoints saved before session 11) or
# "two_level" (float offsets in two levels, GGUF Q4_K's form: `QuantizedWeight.super_scales`).
FORMATS = [("int8", None, "sym"), ("fp8", None, "sym"), ("int4", 128, "sym"), ("int4", 128, "zp"),
           ("int4", 128, "offsets"), ("int4", 32, "offsets"), ("int8", 32, "sym"),   # GGUF Q4_1 / Q4_K, Q8_0
           ("fp8", 128, "sym"),   # FP8 checkpoints with 128 x 128 block scales
           ("int4", 64, "offsets"),   # groups of 64 with float offsets (4.5 bits per weight)
           ("int4", 32, "two_level")]   # GGUF Q4_K as it loads: uint8 rows under float16 rows per 256
DECODE_ROWS = 8   # the engine's decode step on a GPU runs at least 8 rows
MIN_ROTATION_BYTES = 256 << 20


def device_ms(fn, *args, iterations: int = 20) -> float:
    """Median CUPTI time (ms) of all kernels that one call of the jitted fn launches."""
    fn(*args)  # compile + warm up
    _, times = profiler.measure(fn, iterations=iterations)(*args)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (bytes read + bytes written)."""
    x = jnp.arange(1 << 29, dtype=jnp.uint32)
    ms = device_ms(jax.jit(lambda a: a ^ 1), x)
    return 2 * x.nbytes / (ms * 1e-3)


def _name(fmt, group_size, zeros) -> str:   # e.g. "int8", "int4_g128", "int4_g128_zp"
    return f"{fmt}{'' if group_size is None else f'_g{group_size}'}{'' if zeros == 'sym' else f'_{zeros}'}"


def rotated(fn):
    """One jitted call that applies fn to each weight copy (defeats L2 reuse); returns all outputs."""
    return jax.jit(lambda x, ws: [fn(x, w) for w in ws])


def quantized_as(w, fmt, g, zeros):
    """w quantized as the engine holds each benchmarked format: zeros "sym", "zp" (integer zero
    points), "offsets" (float offsets, GGUF Q4_1) or "two_level" (GGUF Q4_K as it loads)."""
    if zeros == "two_level":
        return like_gguf(w, "Q4_K")
    qw = quantize(w, fmt, group_size=g, symmetric=zeros == "sym")
    return with_float_offsets(qw) if zeros == "offsets" else qw


def bench_decode(k, n, m, results, configs, formats=FORMATS):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    copies = max(2, -(-MIN_ROTATION_BYTES // w.nbytes))
    ws = [w + i for i in range(copies)]
    bf16_ms = device_ms(rotated(lambda x, w: x @ w), x, ws) / copies
    row = {"K": k, "N": n, "M": m, "bf16_us": bf16_ms * 1e3, "bf16_bytes": w.nbytes}
    for fmt, g, zeros in formats:
        qw = quantized_as(w, fmt, g, zeros)
        copies = max(2, -(-MIN_ROTATION_BYTES // weight_nbytes(qw)))
        qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]
        ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(qw)), np.float32)
        name = _name(fmt, g, zeros)
        for cname, cfg in configs.items():   # cfg None: what the engine runs (backend "auto")
            try:
                fn = ((lambda x, w: quantized_matmul(x, w)) if cfg is None else
                      (lambda x, w, cfg=cfg: quantized_matmul(x, w, backend="pallas", config=cfg)))
                y = np.asarray(fn(x, qw), np.float32)
                err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                ms = device_ms(rotated(fn), x, qws) / copies
                moved = weight_nbytes(qw) + x.nbytes + m * n * 2
                row[f"{name}/{cname}"] = {"us": ms * 1e3, "bytes": moved, "rel_err": err}
            except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
                row[f"{name}/{cname}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    results["decode"].append(row)
    return row


def bench_prefill(k, n, m, results):
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    row = {"K": k, "N": n, "M": m, "bf16_us": device_ms(jax.jit(lambda x, w: x @ w), x, w) * 1e3}
    for fmt, g, zeros in FORMATS[:4]:
        qw = quantize(w, fmt, group_size=g, symmetric=zeros == "sym")
        name = _name(fmt, g, zeros)
        for path, kw in [("pallas_tm128", dict(prefill="pallas")),
                         ("pallas_tm256", dict(prefill="pallas", config=QuantMatmulConfig(tile_m=256))),
                         ("xla_dequant_dot", dict(prefill="xla"))]:
            try:
                fn = jax.jit(lambda x, w, kw=kw: quantized_matmul(x, w, backend="pallas", **kw))
                row[f"{name}/{path}"] = {"us": device_ms(fn, x, qw, iterations=10) * 1e3}
            except Exception as e:  # noqa: BLE001
                row[f"{name}/{path}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    results["prefill"].append(row)
    return row


SWEEP_SHAPES = [(4096, 28672), (14336, 4096), (4096, 6144), (4096, 4096)]   # gate_up, down, qkv, o_proj (K, N)
SWEEP_FORMATS = [("int4", 128, "zp"), ("int4", 32, "two_level"), ("fp8", None, "sym"), ("int8", None, "sym"),
                 ("int4", 32, "offsets"), ("int8", 32, "sym"), ("fp8", 128, "sym")]


def _sweep_shape(spec: str) -> tuple[int, int]:
    """An index into SWEEP_SHAPES, or K x N given as e.g. "8192x2048"."""
    if "x" in spec:
        k, n = spec.split("x")
        return int(k), int(n)
    return SWEEP_SHAPES[int(spec)]


def _via(**kw):
    return lambda x, w: quantized_matmul(x, w, **kw)


def _rows_kernel(m_tile, depth=4, k_splits=1):   # a weight it does not take raises, recorded as the path's error
    """m_tile None: one M tile holding every row (`rows_matmul.one_tile`)."""
    return lambda x, w: rows_kernel.rows_matmul(x, w, m_tile=m_tile or rows_kernel.one_tile(x.shape[0]),
                                                k_splits=k_splits, max_concurrent_steps=depth)


ROWS_PATH = re.compile(r"rows_tm(\d+|all)(?:_k(\d+))?(?:_d(\d+))?")


def _sweep_path(name: str):
    """A path of SWEEP_PATHS, or any rows kernel config named rows_tm<T|all>[_k<splits>][_d<depth>]
    (e.g. rows_tmall_k4: one M tile of every row, K in four parts)."""
    if name in SWEEP_PATHS:
        return SWEEP_PATHS[name]
    match = ROWS_PATH.fullmatch(name)
    if match is None:
        raise ValueError(f"unknown path {name!r}: one of {', '.join(SWEEP_PATHS)} or rows_tm<T|all>[_k<S>][_d<D>]")
    tile, splits, depth = match.groups()
    return _rows_kernel(None if tile == "all" else int(tile), int(depth or 4), int(splits or 1))


# Paths of the rows sweep: what the engine runs, and the alternatives (the fused kernel on M tiles
# of 128 or 256 rows, with the group scales applied per group's partial or folded into the tile; the
# warp-specialized rows kernel; the dequantized weight through XLA's dot, which for per-channel
# int8 / fp8 is XLA's convert-fused GEMM: what they ran before the rows kernel took them).
SWEEP_PATHS = {
    "engine": _via(),
    "fused_tm128": _via(backend="pallas", prefill="pallas"),
    "fused_prescaled_tm128": _via(backend="pallas", prefill="pallas", config=QuantMatmulConfig(prescale=True)),
    "fused_prescaled_tm256": _via(backend="pallas", prefill="pallas", config=QuantMatmulConfig(prescale=True, tile_m=256)),
    "xla_dequant_dot": _via(backend="xla"),
    # before session 84 past 1,024 rows: XLA's convert-fused GEMM (per channel; f32 out, the channel scale after) and
    # the weight dequantized to [K, N] for XLA's dot (grouped)
    "xla_convert": lambda x, w: xla_convert_matmul(x, w).astype(jnp.bfloat16),
    "xla_kn": lambda x, w: jnp.dot(x, dequantize(w, jnp.bfloat16),
                                   preferred_element_type=jnp.float32).astype(jnp.bfloat16),
    # the weight dequantized as stored (W.T, scales multiplied in) and XLA's GEMM writing bf16 itself
    "xla_nk": lambda x, w: dequantized_dot(x, w, jnp.bfloat16),
    "xla_nk_barrier": lambda x, w: dequantized_dot(x, w, jnp.bfloat16, barrier=True),
    # pallas_kernels/rows_matmul.py: warp-specialized, M tiles of 128 / 256 rows, K unsplit or in 2 / 4
    "rows_tm128": _rows_kernel(128),
    "rows_tm128_k2": _rows_kernel(128, k_splits=2),
    "rows_tm128_k4": _rows_kernel(128, k_splits=4),
    "rows_tm256": _rows_kernel(256),
    "rows_tm256_d2": _rows_kernel(256, 2),
}


def bench_rows(k, n, rows, results, formats=SWEEP_FORMATS, paths=SWEEP_PATHS):
    """Each format at each row count: what the engine runs and the alternatives (per-channel int8 /
    fp8: XLA's convert-fused GEMM, and the fused kernel), against the bf16 dot. Weights rotated past
    the L2 as in the decode rows."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
    copies = max(2, -(-MIN_ROTATION_BYTES // w.nbytes))
    ws = [w + i for i in range(copies)]
    qws = {}
    for fmt, g, zeros in formats:
        qw = quantized_as(w, fmt, g, zeros)
        qws[_name(fmt, g, zeros)] = [jax.tree.map(jnp.copy, qw)
                                     for _ in range(max(2, -(-MIN_ROTATION_BYTES // weight_nbytes(qw))))]
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
        iters = 20 if m <= 256 else 10
        row = {"K": k, "N": n, "M": m, "bf16_us": device_ms(rotated(lambda x, w: x @ w), x, ws, iterations=iters) / copies * 1e3}
        for name, copies_q in qws.items():
            ref = None
            for path, fn in paths.items():
                if is_per_channel(copies_q[0]) and path.startswith("fused_prescaled"):
                    continue   # per channel there is no group scale to fold into the tile
                try:
                    y = np.asarray(jax.jit(fn)(x, copies_q[0]), np.float32)
                    if ref is None:
                        ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(copies_q[0])), np.float32)
                    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    us = device_ms(rotated(fn), x, copies_q, iterations=iters) / len(copies_q) * 1e3
                    row[f"{name}/{path}"] = {"us": us, "rel_err": err}
                except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
                    row[f"{name}/{path}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        results["rows"].append(row)
        yield row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first decode shape only, no prefill")
    parser.add_argument("--rows", type=int, default=DECODE_ROWS, help="activation rows of the decode rows")
    parser.add_argument("--formats", help="comma-separated names to run (e.g. int4_g128,int4_g128_zp); default all")
    parser.add_argument("--no-prefill", action="store_true", help="decode shapes only")
    parser.add_argument("--sweep-rows", help="comma-separated row counts (e.g. 32,128,256,512,1024): "
                        "instead of the decode and prefill tables, each format's paths at each count "
                        "on the 8B's projection shapes (--formats picks from "
                        + ",".join(_name(*f) for f in SWEEP_FORMATS) + ")")
    parser.add_argument("--shapes", default="0,1,2,3", help="--sweep-rows: which of gate_up, down, qkv, o_proj (indices), or any K x N "
                        "(e.g. 8192x2048)")
    parser.add_argument("--paths", help="--sweep-rows: comma-separated paths (default all: " + ",".join(SWEEP_PATHS)
                        + "; or any rows_tm<T|all>[_k<splits>][_d<depth>])")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    formats = FORMATS
    if args.formats:
        keep = set(args.formats.split(","))
        formats = [f for f in FORMATS if _name(*f) in keep]
        if not formats:
            parser.error(f"--formats {args.formats!r} names none of the formats")
    t0 = time.time()
    dev = jax.devices()[0]
    results = {"device": dev.device_kind, "jax": jax.__version__,
               "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "decode": [], "prefill": [], "rows": []}
    results["copy_GBps"] = copy_bandwidth() / 1e9
    print(f"{dev.device_kind}  jax {jax.__version__}  copy {results['copy_GBps']:.0f} GB/s", flush=True)
    if args.sweep_rows:
        rows = [int(r) for r in args.sweep_rows.split(",")]
        sweep = SWEEP_FORMATS if not args.formats else [f for f in SWEEP_FORMATS if _name(*f) in keep]
        try:
            paths = SWEEP_PATHS if not args.paths else {p: _sweep_path(p) for p in args.paths.split(",")}
        except ValueError as e:
            parser.error(str(e))
        for k, n in [_sweep_shape(s) for s in args.shapes.split(",")]:
            for row in bench_rows(k, n, rows, results, sweep, paths):
                for key, v in row.items():
                    if isinstance(v, dict):
                        msg = v.get("error") or (f"{v['us']:9.1f} us  {v['us'] / row['bf16_us']:5.2f}x bf16 "
                                                 f"({row['bf16_us']:.1f} us)  err {v['rel_err']:.1e}")
                        print(f"rows M={row['M']:5d} K={k:6d} N={n:6d} {key:34s} {msg}", flush=True)
                print(f"  [{time.time() - t0:.0f}s]", flush=True)
                with open(os.path.join(args.out, "bench_quant_rows.json"), "w") as f:
                    json.dump(results, f, indent=1)
        return
    configs = {"engine": None, "pallas": QuantMatmulConfig(),
               "pallas_unfolded": QuantMatmulConfig(fold_zeros=False)}   # differs for asym groups under 128 only
    for k, n in DECODE_SHAPES[:1] if args.quick else DECODE_SHAPES:
        row = bench_decode(k, n, args.rows, results, configs, formats)
        for key, v in row.items():
            if isinstance(v, dict):
                if "error" in v:
                    print(f"decode K={k} N={n} {key}: {v['error']}", flush=True)
                else:
                    gbps = v["bytes"] / v["us"] / 1e3
                    print(f"decode K={k:6d} N={n:6d} {key:22s} {v['us']:8.1f} us  {gbps:6.0f} GB/s "
                          f"({100 * gbps / results['copy_GBps']:4.0f}% of copy)  x{row['bf16_us'] / v['us']:.2f} "
                          f"vs bf16 ({row['bf16_us']:.1f} us)  err {v['rel_err']:.1e}", flush=True)
        print(f"  [{time.time() - t0:.0f}s]", flush=True)
    if not (args.quick or args.no_prefill):
        for k, n in [(4096, 6144), (4096, 28672), (14336, 4096)]:
            row = bench_prefill(k, n, 2048, results)
            for key, v in row.items():
                if isinstance(v, dict):
                    msg = v.get("error") or f"{v['us']:8.1f} us  = {v['us'] / row['bf16_us']:.2f}x bf16 ({row['bf16_us']:.1f} us)"
                    print(f"prefill M=2048 K={k} N={n} {key:22s} {msg}", flush=True)
            print(f"  [{time.time() - t0:.0f}s]", flush=True)
    with open(os.path.join(args.out, "bench_quant.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

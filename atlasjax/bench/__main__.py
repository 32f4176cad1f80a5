"""`python -m atlasjax.bench latency|throughput|embed|serve|kernels ...` (each mode has --help)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from atlasjax.bench.gguf_layouts import LAYOUTS as GGUF_LAYOUTS
from atlasjax.bench.presets import PRESETS, progress
from atlasjax.__main__ import (add_attention_backend_arg, add_compilation_cache_arg, add_decode_batch_sizes_arg,
                               add_kv_cache_dtype_arg, add_long_context_decode_arg, add_memory_utilization_arg,
                               add_scheduler_steps_arg, add_weight_format_args, token_count)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF model directory or .gguf file (default: the embedded model)")
    src.add_argument("--preset", default=None, choices=sorted(PRESETS),
                     help="a published architecture with random weights built on the device (no download)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights for --model's config.json (no weight file read), as vLLM's")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on GPU, float32 on CPU")
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help='vLLM\'s: RoPE and positions over the model\'s config, e.g. \'{"rope_scaling": {"rope_type": '
                        '"yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\' for Qwen3 contexts '
                        'past 40,960 tokens (atlasjax/hf_overrides.py)')
    add_weight_format_args(g, GGUF_LAYOUTS)
    g.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("engine (unset: the mode's default, then EngineConfig's)")
    e.add_argument("--max-num-seqs", type=int, default=None)
    add_decode_batch_sizes_arg(e)
    e.add_argument("--max-model-len", type=token_count, default=None, help="4096, 32k (32,000), 128K (131,072)")
    e.add_argument("--page-size", type=int, default=16)
    e.add_argument("--num-pages", type=int, default=None)
    add_kv_cache_dtype_arg(e)
    add_memory_utilization_arg(e)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--no-async-scheduling", action="store_true", help="read each step back before the next")
    add_scheduler_steps_arg(e)
    add_attention_backend_arg(e)
    add_long_context_decode_arg(e)
    e.add_argument("--compile-at-start", action="store_true",
                   help="compile every step shape as the engine starts, before the KV pool, as a server does")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="devices to split the model over")
    e.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or a '
                        'draft model \'{"model": "path/to/draft", "num_speculative_tokens": 4}\' '
                        '("preset:llama-3.2-1b": a preset\'s random weights; latency reports the drafts\' acceptance)')
    e.add_argument("--enable-lora", action="store_true",
                   help="LoRA slots beside the weights: every step computes each slot's LoRA term (masked per "
                        "token), so the requests (on the base model here) cost what adapters cost")
    e.add_argument("--max-loras", type=int, default=None, help="with --enable-lora: device slots (default 1)")
    e.add_argument("--max-lora-rank", type=int, default=None, help="with --enable-lora: slot rank (default 16)")
    add_compilation_cache_arg(e, default_on_gpu=False)   # its reports time cold compiles
    p.add_argument("--compare", default=None, choices=["hf"],
                   help="also run Hugging Face transformers on the same shapes and print the ratio")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default=None, help="write every figure to this JSON file")
    p.add_argument("-v", "--verbose", action="store_true", help="log every compile to stderr")


def build_parser() -> argparse.ArgumentParser:
    from atlasjax.bench import embed, kernels, latency, serve, throughput  # noqa: PLC0415
    parser = argparse.ArgumentParser(prog="python -m atlasjax.bench", description="atlasjax benchmarks")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("latency", help="one fixed batch: TTFT, TPOT, tok/s (median, p10, p90)")
    _add_model_args(p)
    latency.add_args(p)
    _add_common(p)
    p = sub.add_parser("throughput", help="N requests through the engine at once: requests/s, tok/s")
    _add_model_args(p)
    throughput.add_args(p)
    _add_common(p)
    p = sub.add_parser("embed", help="N inputs through LLMEngine.embed: inputs/s, tokens/s, matmul roofline")
    _add_model_args(p)
    embed.add_args(p)
    _add_common(p)
    p = sub.add_parser("serve", help="load generator against an OpenAI-compatible server (HTTP streaming)")
    serve.add_args(p)
    _add_common(p)
    p = sub.add_parser("kernels", help="copy bandwidth, matmul rate, and the kernel benchmarks")
    kernels.add_args(p)
    _add_common(p)
    return parser


def _hf_comparison(args) -> dict | None:
    from atlasjax.bench import hf_compare  # noqa: PLC0415
    from atlasjax.bench.presets import model_config  # noqa: PLC0415
    if not hf_compare.is_available():
        progress("--compare hf: torch/transformers are not importable; skipping the comparison")
        return dict(error="torch or transformers not importable")
    cfg = model_config(args)
    if args.mode == "latency":
        bs, n_in, n_out, iters = args.batch_size, args.input_len, args.output_len, args.num_iters
    else:
        bs, n_in, n_out, iters = args.max_num_seqs or 16, args.input_len, args.output_len, 1
    progress(f"--compare hf: transformers on {bs} x {n_in} in / {n_out} out (before JAX takes the device)")
    return hf_compare.run_subprocess(cfg, batch_size=bs, input_len=n_in, output_len=n_out, num_iters=iters,
                                     dtype=args.dtype, seed=args.seed)


def main(argv=None) -> int:
    from atlasjax.errors import AtlasJaxError  # noqa: PLC0415
    try:
        return _main(argv)
    except AtlasJaxError as e:   # a bad flag or model: its reason, as `python -m atlasjax` says it
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from atlasjax.bench import report  # noqa: PLC0415
    if args.mode == "serve":
        # The server may share this machine's GPU: take device memory only as needed.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        from atlasjax.bench import serve  # noqa: PLC0415
        rep, tables, used_device = serve.run(args)
        report.finish(rep, argv, args.output, tables, with_device=used_device)
        return 1 if rep["results"]["completed"] == 0 else 0
    if args.mode == "latency":
        from atlasjax.bench import latency  # noqa: PLC0415
        latency.compare_formats(args)   # a bad --compare-quantization fails before any device work
    if args.mode == "embed" and args.compare:
        raise SystemExit("--compare hf compares generation; the embed mode has no Hugging Face run")
    hf = _hf_comparison(args) if getattr(args, "compare", None) == "hf" else None
    from atlasjax.step_options import use_process_flags  # noqa: PLC0415
    use_process_flags(getattr(args, "tensor_parallel_size", 1))   # before measuring starts the backend
    from atlasjax import compile_cache  # noqa: PLC0415
    compile_cache.enable(compile_cache.resolve(getattr(args, "compilation_cache", None)))   # before any compile
    from atlasjax.bench.roofline import measure_ceilings  # noqa: PLC0415
    progress("measuring device ceilings (copy bandwidth, matmul rate)")
    ceilings = measure_ceilings()
    progress(f"copy {ceilings['copy_bandwidth_Bps'] / 1e9:.0f} GB/s, {ceilings['matmul_dtype']} matmul "
             f"{ceilings['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s")
    if args.mode == "kernels":
        from atlasjax.bench import kernels  # noqa: PLC0415
        rep, tables = kernels.run(args, ceilings)
    elif args.mode == "latency":
        from atlasjax.bench import latency  # noqa: PLC0415
        rep, tables = latency.run(args, ceilings, hf)
    elif args.mode == "embed":
        from atlasjax.bench import embed  # noqa: PLC0415
        rep, tables = embed.run(args, ceilings)
    else:
        from atlasjax.bench import throughput  # noqa: PLC0415
        rep, tables = throughput.run(args, ceilings, hf)
    report.finish(rep, argv, args.output, tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())

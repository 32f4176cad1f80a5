"""Command line: `python -m atlasjax generate|chat|serve|save ...` (run with --help for each)."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from atlasjax.engine_config import ATTENTION_BACKENDS, KV_CACHE_DTYPES


def add_attention_backend_arg(g) -> None:
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="interpret: the Pallas kernels in Mosaic GPU interpret mode (slow; checks them on a CPU)")


def add_weight_format_args(g, layouts: tuple[str, ...] = ()) -> None:
    """--quantization and --quantize-lm-head (the serving CLI and the bench share them); `layouts`:
    further --quantization choices (the bench's GGUF-shaped presets)."""
    more = (f"; {', '.join(layouts)}: a preset laid out as a llama.cpp file of that type loads "
            "(its LM head included)") if layouts else ""
    g.add_argument("--quantization", default=None, choices=["int8", "fp8", "int4", *layouts],
                   help="quantize the linear projections (q/k/v/o, gate/up/down) at load (weight-only)" + more)
    g.add_argument("--quantization-group-size", type=int, default=None, metavar="N",
                   help="with --quantization int4 or int8: weights per scale along K (32, 64, 128, ...; "
                        "default: int4 128, int8 one scale per output channel). Smaller groups are more "
                        "accurate and cost more bytes")
    g.add_argument("--quantization-symmetric", action="store_true", default=None,
                   help="with --quantization int4: no zero points (scale = absmax / 7): fewer bytes, less "
                        "accurate (default: asymmetric, an integer zero point per group)")
    g.add_argument("--activation-quantization", default=None, choices=["fp8", "int8"],
                   help="fp8 / int8: per-channel weights of that format (--quantization fp8 / int8, or such a "
                        "checkpoint) multiply products of 256 rows or more (prefill chunks, large decode "
                        "batches) by activations rounded per token to it, on the 8-bit tensor cores (W8A8, as "
                        "vLLM runs fp8 and int8 W8A8 checkpoints): faster prefill, a little less accurate "
                        "(docs/quantization.md; int8 weights quantized at load are smoothed first, as "
                        "SmoothQuant). Default: bf16 activations")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization: quantize the untied LM head too (Llama-3.1-8B: 1.05 GB bf16 -> "
                        "0.53 GB int8; default: it stays in --dtype; a tied LM head, i.e. the embedding "
                        "table, is never quantized)")


def add_kv_cache_dtype_arg(g) -> None:
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype (default auto: --dtype). fp8 (= fp8_e4m3) stores K and V in 8 bits, "
                        "unscaled and saturating at +-448: twice the tokens fit in the pool and decode "
                        "attention reads half the bytes, at a small cost in accuracy (docs/serving.md)")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="with an fp8 KV cache: measure each layer's K and V scales on a calibration text at "
                        "start and fold them into the attention weights (for checkpoints without calibrated "
                        "k_scale / v_scale; one host)")


def add_scheduler_steps_arg(g) -> None:
    g.add_argument("--num-scheduler-steps", type=int, default=None, metavar="K",
                   help="decode iterations per launch when a step has only decodes (default: 4 on GPU, 1 "
                        "elsewhere): the host issues one step for K tokens per sequence, which speeds up "
                        "host-bound decoding (small or quantized models, small batches); tokens then stream "
                        "in bursts of up to K. With a draft model or an EAGLE-3 head, K verify rounds per "
                        "launch. 1: one token (or one verify round) per step")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None


_SUFFIXES = {"k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def token_count(text: str) -> int:
    """A token count as vLLM's --max-model-len takes it: 4096, 1k (1,000), 1K (1,024), 25.6k (25,600), 128K."""
    number, scale = (text[:-1], _SUFFIXES[text[-1]]) if text and text[-1] in _SUFFIXES else (text, 1)
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count such as 4096, 32k or 128K, got {text!r}") from None
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number of tokens, got {text!r}")
    return int(value)


def add_decode_batch_sizes_arg(g) -> None:
    g.add_argument("--decode-batch-sizes", type=_sizes, default=None, metavar="N[,N...]",
                   help="row counts the decode step is compiled for (at least 8 on GPU, where one row takes "
                        "XLA's slower matrix-vector path); a step runs the smallest that holds its "
                        "requests (default: 8, 16, 32, ... below --max-num-seqs, then --max-num-seqs). "
                        "Give --max-num-seqs alone to run every step at full size")


def add_long_context_decode_arg(g) -> None:
    g.add_argument("--long-context-decode", default="auto", choices=["auto", "on", "off"],
                   help="compile the 8-, 16- and 32-row decode steps (the default buckets) again with their "
                        "attention's context splits sized for fewer busy rows, and run that while at most 6 "
                        "requests decode and one context reaches 1,024 tokens (7, 9-10 or 17-20: 2,048; a "
                        "lone request past 4,096 tokens: splits for one row). A lone 4k-token request's fp8 8B "
                        "step: 3.02 against 3.57 ms on an H200; max-model-len > 1024 only "
                        "(atlasjax/long_context_decode.py). auto: on a GPU with Pallas attention")


def long_context_decode_setting(args) -> bool | None:
    return {"auto": None, "on": True, "off": False}[getattr(args, "long_context_decode", "auto")]


def add_memory_utilization_arg(g) -> None:
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85, metavar="F",
                   help="without --num-pages: the fraction of free device memory (after the weights and a "
                        "reserve for activations) the KV pool takes (default 0.85); the rest is left for "
                        "compiling and running the steps")


def add_compilation_cache_arg(g, default_on_gpu: bool = True) -> None:
    default = "on a GPU ~/.cache/atlasjax/xla (at most 10 GiB), elsewhere none" if default_on_gpu else "none"
    g.add_argument("--compilation-cache", default=None, metavar="DIR|off",
                   help="a directory for jax's persistent compilation cache, so a later run loads the "
                        f"compiled steps instead of compiling them (default: $ATLASJAX_COMPILATION_CACHE, else "
                        f"{default}; off: none). A restarted server loads its step executables from it "
                        "(docs/serving.md)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory, .gguf file or saved atlasjax checkpoint (default: embedded SmolLM2-135M)")
    g.add_argument("--revision", default=None,
                   help="with a Hugging Face Hub id as --model: the branch, tag or commit to load (default: main)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights for --model's config.json (its tokenizer kept, no weight file read), "
                        "to serve or benchmark a published model's shapes without its weights (vLLM's)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="use the tokenizer (tokenizer.json, tokenizer_config.json with its chat template) in DIR "
                        "instead of the model's own (vLLM's; e.g. a GGUF file's model with its Hugging Face tokenizer)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--max-num-seqs", type=int, default=16)
    add_decode_batch_sizes_arg(g)
    g.add_argument("--max-model-len", type=token_count, default=None,
                   help="the longest prompt + output a request may have (4096, 32k = 32,000, 128K = 131,072; "
                        "default: the model's positions, up to 4,096)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=None)
    add_kv_cache_dtype_arg(g)
    add_memory_utilization_arg(g)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="GiB of host memory under the prefix cache: pages the device pool evicts are kept there and "
                        "copied back when a prompt needs them again, instead of computed again (default: off)")
    g.add_argument("--kv-offloading-disk", default=None, metavar="DIR",
                   help="with --kv-offloading-size: a third tier in files under DIR; pages saved to host memory are "
                        "written there too and outlive the server (a restart on the same weights reads them back)")
    g.add_argument("--kv-offloading-disk-size", type=float, default=None, metavar="GIB",
                   help="GiB of files --kv-offloading-disk may hold (least recently used dropped first)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="which waiting request a free slot admits and which running one is preempted when "
                        "pages run out: fcfs (arrival order) or priority (requests' `priority`, lower first, "
                        "then arrival)")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step back before scheduling the next (no host/device overlap; for debugging)")
    add_scheduler_steps_arg(g)
    add_attention_backend_arg(g)
    add_long_context_decode_arg(g)
    add_weight_format_args(g)
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices to split the model over (multi-host: all devices of all processes)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="render chats with this Jinja template instead of the model's (a file's path, or the "
                        "template itself), e.g. for a base model or a GGUF file without one; `save` keeps it")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                   help="the model's generation_config.json: its end-of-turn ids end sequences and its "
                        "temperature / top_p / top_k / min_p / repetition_penalty / max_new_tokens become the "
                        "server's defaults for requests that leave them out (auto: the file beside the "
                        "checkpoint; vllm: ignore it; PATH: that directory or file). The generate / chat "
                        "commands take its end ids; their sampling comes from their own flags")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='vLLM\'s: sampling defaults over the generation_config.json ones (over none with '
                        '--generation-config vllm), e.g. \'{"temperature": 0.6, "top_p": 0.95, "max_new_tokens": '
                        '1024}\' (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)')
    g.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling: serve embeddings, scores and classification only (an embedding model: "
                        "Qwen3-Embedding, ...): no generation steps compiled, a KV pool of one sequence, the "
                        "embedding batch sizes compiled at start instead; auto (default): pooling for a checkpoint "
                        "without an LM head (a base model, a classifier), else generate")
    g.add_argument("--pooling-type", default=None, choices=["last", "mean", "cls", "max"],
                   help="how embeddings (/v1/embeddings, /v1/score) pool the final hidden states (default: the "
                        "model's sentence-transformers config, else the last token)")
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help='vLLM\'s: config.json keys over the model\'s. RoPE and positions: \'{"rope_scaling": '
                        '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\' runs '
                        'Qwen3 to 131,072 tokens (with --max-model-len); rope_theta, max_position_embeddings, '
                        'sliding_window, use_sliding_window. Cross-encoders: \'{"architectures": '
                        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
                        '"is_original_qwen3_reranker": true}\' serves Qwen3-Reranker: /score and /rerank score each '
                        'pair (docs/serving.md)')
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s flag: n-gram drafts looked up in each request\'s own '
                        'tokens (\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\') or a '
                        'smaller draft model\'s (\'{"model": "path/to/draft", "num_speculative_tokens": 4}\') or an '
                        'EAGLE-3 head\'s (\'{"method": "eagle3", "model": "path/to/head", "num_speculative_tokens": '
                        '3}\'), verified in one step. docs/speculative_decoding.md')
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters per request (PEFT directories; --lora-modules for the server, "
                        "lora_request= in Python); docs/serving.md")
    g.add_argument("--max-loras", type=int, default=1, help="adapters resident on the device at once (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank taken (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept read in host memory (default: --max-loras)")
    g.add_argument("--profiler-dir", default=None, metavar="DIR",
                   help="where start_profile writes jax.profiler traces of the engine (XProf and Perfetto files); a "
                        "server then serves POST /start_profile and /stop_profile, as vLLM's with its profiler "
                        "directory set (default: $ATLASJAX_PROFILER_DIR)")
    add_compilation_cache_arg(g)
    d = p.add_argument_group("multi-host (same command on every host; default: $ATLASJAX_COORDINATOR_ADDRESS, "
                             "$ATLASJAX_NUM_PROCESSES, $ATLASJAX_PROCESS_ID)")
    d.add_argument("--coordinator-address", default=None, help="host:port of process 0's coordinator")
    d.add_argument("--num-processes", type=int, default=None)
    d.add_argument("--process-id", type=int, default=None)


def engine_kwargs(args) -> dict:
    return dict(model=args.model, revision=args.revision, load_format=args.load_format, tokenizer=args.tokenizer,
                dtype=args.dtype,
                kv_cache_dtype=args.kv_cache_dtype,
                calculate_kv_scales=args.calculate_kv_scales,
                max_num_seqs=args.max_num_seqs, decode_batch_sizes=args.decode_batch_sizes,
                max_model_len=args.max_model_len,
                page_size=args.page_size, num_pages=args.num_pages, max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=not args.no_prefix_caching, kv_offloading_size=args.kv_offloading_size,
                kv_offloading_disk=args.kv_offloading_disk, kv_offloading_disk_size=args.kv_offloading_disk_size,
                async_scheduling=not args.no_async_scheduling,
                scheduling_policy=args.scheduling_policy,
                num_scheduler_steps=args.num_scheduler_steps, attention_backend=args.attention_backend,
                long_context_decode=long_context_decode_setting(args),
                quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                activation_quantization=args.activation_quantization,
                quantization_group_size=args.quantization_group_size,
                quantization_symmetric=args.quantization_symmetric,
                tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
                chat_template=args.chat_template, generation_config=args.generation_config,
                override_generation_config=getattr(args, "override_generation_config", None),
                pooling_type=args.pooling_type, runner=args.runner,
                speculative_config=getattr(args, "speculative_config", None),
                hf_overrides=getattr(args, "hf_overrides", None),
                enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                max_cpu_loras=args.max_cpu_loras, profiler_dir=args.profiler_dir,
                # a server or batch run compiles at start (every process of a multi-host one, too)
                compile_at_start=getattr(args, "command", None) in ("serve", "run-batch"))


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling(args):
    from atlasjax.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.sampling_seed, stop=args.stop)


def _run_generate(args, chat: bool) -> None:
    from atlasjax.llm import LLM
    params = _sampling(args)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    print(f"atlasjax: model loaded in {time.perf_counter() - t0:.1f}s ({llm.engine.weights_summary}); "
          "compiling and generating ...", file=sys.stderr, flush=True)
    t1 = time.perf_counter()
    if chat:
        outs = llm.chat([{"role": "user", "content": p} for p in args.prompt][:1], params)
    else:
        outs = llm.generate(list(args.prompt), params)
    dt = time.perf_counter() - t1
    llm.engine.stop_followers()   # multi-host: the other processes may exit now
    for out in outs:
        print(out.outputs[0].text)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    runner = llm.engine.runner
    published = getattr(runner, "published", 0)   # multi-host: steps sent to the other processes
    extra = f"; {published} steps published, {1e3 * runner.publish_seconds / published:.2f} ms each" if published else ""
    print(f"atlasjax: {n} tokens in {dt:.2f}s ({runner.num_compiles} compiles, "
          f"{runner.compile_seconds:.1f}s of them{extra})", file=sys.stderr)


def _run_save(args) -> None:
    from atlasjax.llm import LLM
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    llm.save(args.output)
    llm.engine.stop_followers()   # multi-host: the other processes joined the gather and may exit now
    print(f"atlasjax: wrote {args.output} in {time.perf_counter() - t0:.1f}s; load it with --model {args.output}",
          file=sys.stderr)


def _start_distributed(args) -> bool:
    """Multi-host: initialize jax.distributed; on processes other than 0, build the engine and
    follow process 0's steps (returns True when done). Single process: nothing (returns False)."""
    from atlasjax import distributed
    from atlasjax.errors import EngineConfigError
    config = distributed.DistributedConfig.from_env(args.coordinator_address, args.num_processes, args.process_id)
    if config is None:
        return False   # one process (and no device touched yet: an engine process may own them)
    if getattr(args, "engine_process", False):
        raise EngineConfigError("--engine-process serves one host; leave it off for multi-host runs")
    if getattr(args, "data_parallel_size", 1) > 1:
        raise EngineConfigError("--data-parallel-size runs its replicas on one host; leave it off for multi-host "
                                "runs (or start one multi-host server per replica)")
    distributed.initialize(config)
    if not distributed.is_multiprocess() or distributed.is_leader():
        return False
    from atlasjax.engine import LLMEngine
    from atlasjax.engine_config import EngineConfig
    LLMEngine(EngineConfig(**engine_kwargs(args))).follow()
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m atlasjax", description="atlasjax: JAX LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every compile")
    # -v also after the command (`serve -v`); SUPPRESS keeps a given top-level -v
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log every compile")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("generate", "complete one or more prompts"), ("chat", "one chat turn with the model")):
        p = sub.add_parser(name, help=help_, parents=[verbose])
        p.add_argument("prompt", nargs="+")
        add_engine_args(p)
        _add_sampling_args(p)
    p = sub.add_parser("serve", help="OpenAI/Anthropic-compatible HTTP server", parents=[verbose])
    add_engine_args(p)
    try:
        from serving.cli import add_server_args
        add_server_args(p)
    except ImportError:
        pass
    p = sub.add_parser("run-batch", help="answer an OpenAI Batch API file (JSONL requests to /v1/chat/completions, "
                                         "/v1/completions, /v1/embeddings, ...) offline, as vLLM's run-batch",
                       parents=[verbose])
    add_engine_args(p)
    try:
        from serving.batch import add_batch_args
        add_batch_args(p)
    except ImportError:
        pass
    p = sub.add_parser("save", help="load a model once (quantizing it with --quantization) and write it as an "
                                    "atlasjax checkpoint that later runs load directly", parents=[verbose])
    p.add_argument("output", help="directory to write (created; an existing checkpoint there is replaced)")
    add_engine_args(p)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from atlasjax import compile_cache
    from atlasjax.errors import AtlasJaxError
    compile_cache.enable(compile_cache.resolve(args.compilation_cache, default_on_gpu=True))   # before the first compile
    try:
        if _start_distributed(args):
            return 0   # a follower process: it replayed process 0's steps until process 0 finished
        if args.command == "serve":
            from serving.cli import serve
            return serve(args) or 0
        if args.command == "run-batch":
            from serving.batch import run_batch
            return run_batch(args)
        if args.command == "save":
            _run_save(args)
            return 0
        _run_generate(args, chat=args.command == "chat")
    except AtlasJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

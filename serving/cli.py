"""`python -m atlasjax serve`: load, warm up, serve with uvicorn, drain on SIGINT/SIGTERM.

atlasjax/__main__.py adds the engine flags and calls `add_server_args` and `serve`. Startup:
bind the socket (so a busy port fails before the model loads, and --port 0 picks a free one),
build AsyncLLM, or with --engine-process an EngineProcessLLM (the engine in a child process:
atlasjax/engine_process.py), or with --data-parallel-size N a DataParallelLLM (N of those:
atlasjax/data_parallel.py); the engine compiles every step shape before it allocates the KV pool. Send one
tiny request through it, then start uvicorn on that socket and log "atlasjax: ready on http://HOST:PORT".
A signal makes uvicorn stop accepting and wait for in-flight responses (up to
--graceful-timeout seconds, after which they are cancelled and their requests aborted); then
the engine is drained and shut down and serve() returns 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from atlasjax.profiling import profiler_dir
from serving.app import DEFAULT_MAX_BODY_BYTES, create_app
from serving.reasoning import PARSERS
from serving.response_store import DEFAULT_MAX_STORED

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# With --engine-process: a picklable callable the engine's process runs before it builds the engine (a process
# that patched the loader in itself, as atlasjax.bench.preset_server does, sets it to patch the child too)
engine_process_setup = None


def add_answer_args(g) -> None:
    """How answers are named and shaped: flags `serve` and `run-batch` share."""
    g.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="the model name(s) clients send; with several, each is accepted and listed, and the first "
                        "is the default (default: from the model path)")
    g.add_argument("--lora-modules", default=None, nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters requests name in their \"model\" field: name=path, or vLLM's JSON form "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (needs --enable-lora)")
    g.add_argument("--reasoning-parser", default=None, choices=PARSERS,
                   help="put chat answers' <think>...</think> part in the message's `reasoning_content` (as "
                        "vLLM): qwen3 (the model opens <think> itself) or deepseek_r1 (the chat template opens it: "
                        "DeepSeek-R1 distills, QwQ, Qwen3 Thinking releases)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="name tokens in logprobs as `token_id:N` instead of their text (as vLLM; for tokens that "
                        "do not decode alone); a request's `return_tokens_as_token_ids` field overrides it")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every /v1/completions and /v1/chat/completions stream with a usage chunk, as if it "
                        "asked stream_options.include_usage (vLLM's)")
    g.add_argument("--incremental-streaming-output", action="store_true",
                   help="SGLang's: each event of a /generate stream carries only the new text, ids and logprobs "
                        "(by default each resends the whole answer so far)")


def add_engine_placement_args(g) -> None:
    """Where the engine runs: flags `serve` and `run-batch` share."""
    g.add_argument("--engine-process", action="store_true",
                   help="run the engine in a process of its own, so that HTTP work never holds up its steps "
                        "(one host only)")
    g.add_argument("--data-parallel-size", "-dp", type=_positive, default=1, metavar="N",
                   help="serve N copies of the model, each in an engine process of its own on its own devices (on "
                        "GPUs: N x --tensor-parallel-size of them), each request routed to the copy that served its "
                        "prompt's prefix, else to the least loaded (one host only; docs/serving.md)")
    g.add_argument("--data-parallel-routing", default="prefix", choices=["prefix", "least-loaded"],
                   help="with --data-parallel-size: prefix sends a request to the replica that served its prompt's "
                        "prefix (in whole KV pages) unless that one is much busier, else to the least loaded; "
                        "least-loaded looks at the load alone (default: %(default)s)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    add_answer_args(g)
    add_engine_placement_args(g)
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="port (0: pick a free one, printed when ready)")
    g.add_argument("--api-key", default=None,
                   help="require this key (Authorization: Bearer or x-api-key); default: $ATLASJAX_API_KEY")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS with this certificate (PEM; with --ssl-keyfile, as vLLM's)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    g.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 503")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    g.add_argument("--cors-origins", default=None,
                   help="comma-separated origins allowed by CORS (default: CORS off)")
    g.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish on shutdown")
    g.add_argument("--max-stored-responses", type=_count, default=DEFAULT_MAX_STORED,
                   help="Responses API answers kept in memory (`store`, the default) for GET /v1/responses/{id} and "
                        "`previous_response_id`; the least recently used go first; 0 keeps none (default: %(default)s)")
    g.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="log the engine's throughput, running / waiting requests and KV cache use every SECONDS while "
                        "busy (logger atlasjax.stats at INFO, as vLLM's stats logger; default: %(default)s)")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats lines (vLLM's flag)")
    g.add_argument("--log-requests", action="store_true",
                   help="log each request at INFO (logger atlasjax.requests, as vLLM's --enable-log-requests): its "
                        "prompt length and the sampling settings it changed when submitted, and how each of its "
                        "sequences ended (reason, tokens, first-token and total time); no prompt or answer text")
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="serve POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (vLLM's): the idle engine "
                        "gives its device memory back to a trainer sharing the devices, and takes it again")
    g.add_argument("--enable-weight-updates", action="store_true",
                   help="serve the routes an RL loop drives the server with between rollouts: POST /pause?mode="
                        "abort|wait|keep, POST /resume, GET /is_paused (vLLM's), POST /update_weights_from_disk "
                        "{\"model_path\"} (SGLang's: a checkpoint of the same architecture replaces the weights, "
                        "without compiling again), GET /get_weight_version, POST /pause_generation, "
                        "/continue_generation")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def served_model_name(model: str | None) -> str:
    """The name requests send by default: a Hub id as given (vLLM's), else the checkpoint's directory or file name."""
    from atlasjax.hub import is_hub_id  # noqa: PLC0415
    if model is None:
        return DEFAULT_MODEL_NAME
    if is_hub_id(model):
        return model
    name = os.path.basename(os.path.normpath(model))
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def warm_up(llm, pooling: bool = False) -> None:
    """One tiny greedy request end to end, or one embedding on a pooling runner (every step shape or
    embedding batch size compiled as the engine started: `engine_kwargs` sets `compile_at_start` for serve)."""
    from atlasjax.sampling_params import SamplingParams  # noqa: PLC0415
    ids = (llm.tokenizer.encode("Hello", add_special_tokens=False) if llm.tokenizer else [])[:4] or [0]
    if pooling:
        await llm.embed([ids], None, "atlasjax-warmup")
        return
    async for _ in llm.generate(ids, SamplingParams(max_tokens=2, temperature=0.0), "atlasjax-warmup"):
        pass


def _make_server(config, url: str):
    import uvicorn  # noqa: PLC0415

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(f"atlasjax: ready on {url}", file=sys.stderr, flush=True)
    return Server(config)


def build_llm(args, max_waiting: int):
    """The streaming engine `serve` and `run-batch` drive: an AsyncLLM on an engine thread, an EngineProcessLLM
    (--engine-process) or a DataParallelLLM (--data-parallel-size N)."""
    from atlasjax.__main__ import engine_kwargs  # noqa: PLC0415
    from atlasjax.engine_config import EngineConfig  # noqa: PLC0415
    if args.data_parallel_size > 1:
        from atlasjax.data_parallel import DataParallelLLM  # noqa: PLC0415
        return DataParallelLLM(EngineConfig(**engine_kwargs(args)), args.data_parallel_size, max_waiting=max_waiting,
                               setup=engine_process_setup, routing=args.data_parallel_routing)
    if args.engine_process:
        from atlasjax.engine_process import EngineProcessLLM  # noqa: PLC0415
        return EngineProcessLLM(EngineConfig(**engine_kwargs(args)), max_waiting=max_waiting,
                                setup=engine_process_setup)
    from atlasjax.async_llm import AsyncLLM  # noqa: PLC0415
    return AsyncLLM(max_waiting=max_waiting, **engine_kwargs(args))


def lora_modules_arg(args) -> dict:
    """--lora-modules as {name: LoRARequest}; ValueError names what is wrong."""
    from serving.lora_routes import parse_lora_modules  # noqa: PLC0415
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return lora_modules


def check_lora_modules(llm, lora_modules: dict, max_lora_rank: int) -> None:
    """Read every adapter once: a bad one stops the start (InvalidRequestError), as vLLM's does."""
    from atlasjax.lora import read_adapter  # noqa: PLC0415
    for lora in lora_modules.values():
        read_adapter(lora, llm.engine.model_config, max_lora_rank)


def serve(args) -> int:
    import uvicorn  # noqa: PLC0415

    from atlasjax.errors import InvalidRequestError  # noqa: PLC0415
    try:
        lora_modules = lora_modules_arg(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        print("error: HTTPS needs both --ssl-certfile and --ssl-keyfile", file=sys.stderr)
        return 2
    if args.ssl_certfile is not None:   # read them now: a bad pair stops the start before the model loads
        import ssl  # noqa: PLC0415
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except (OSError, ssl.SSLError) as e:
            print(f"error: cannot use --ssl-certfile {args.ssl_certfile} with --ssl-keyfile {args.ssl_keyfile}: {e}",
                  file=sys.stderr)
            return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    scheme = "https" if args.ssl_certfile else "http"
    url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
    if args.log_requests:
        logging.getLogger("atlasjax.requests").setLevel(logging.INFO)
    stats_interval = 0.0 if args.disable_log_stats else max(args.log_stats_interval, 0.0)
    if stats_interval:
        logging.getLogger("atlasjax.stats").setLevel(logging.INFO)
    llm = build_llm(args, args.max_waiting)
    print(f"atlasjax: {llm.engine.weights_summary}", file=sys.stderr, flush=True)
    defaults = llm.engine.generation_defaults
    if defaults:
        print(f"atlasjax: defaults for requests that leave them out, from {defaults.source}: {defaults.describe()} "
              "(--generation-config vllm ignores them)", file=sys.stderr, flush=True)
    try:
        try:
            check_lora_modules(llm, lora_modules, args.max_lora_rank)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        for replica in getattr(llm, "replicas", [llm]):    # each data-parallel replica answers before "ready"
            asyncio.run(warm_up(replica, pooling=llm.engine.pooling_only))
        origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()] if args.cors_origins else None
        app = create_app(llm, served_model_name=args.served_model_name or served_model_name(args.model),
                         api_key=args.api_key or os.environ.get("ATLASJAX_API_KEY") or None,
                         max_body_bytes=args.max_body_bytes, cors_origins=origins,
                         reasoning_parser=args.reasoning_parser,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                         incremental_streaming_output=args.incremental_streaming_output,
                         force_include_usage=args.enable_force_include_usage,
                         max_stored_responses=args.max_stored_responses, log_stats_interval=stats_interval,
                         enable_sleep_mode=args.enable_sleep_mode, lora_modules=lora_modules,
                         enable_profiler=profiler_dir(args.profiler_dir) is not None,
                         enable_weight_updates=args.enable_weight_updates)
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.graceful_timeout,
                                access_log=args.uvicorn_log_level in ("info", "debug", "trace"),
                                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
        server = _make_server(config, url)
        # uvicorn re-raises the signal it caught once it has shut down; by then we only want to
        # finish the drain below and return, so that re-raise must land in a harmless handler.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
    finally:
        llm.shutdown(drain=True, timeout=args.graceful_timeout)
        llm.engine.stop_followers()   # multi-host: the other processes may exit now
        sock.close()
    print("atlasjax: server stopped", file=sys.stderr, flush=True)
    return 0

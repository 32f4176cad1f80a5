"""`python -m atlasjax run-batch`: an OpenAI Batch API file answered offline, as vLLM's `run-batch`.

Each input line is a request: `{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
"body": {...}}`. Each output line answers one, in input order: `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`; `error` is null when the request was answered 200, else the
API's error object (`message`, `type`, `param`, `code`) with the status in `response`. A line that is not a
request (bad JSON, no custom_id, an unsupported url or method) gets an error line too, and the rest run on.

The requests go through the server's own app in this process (no socket), `max_concurrency` at a time, so they
share the engine's continuous batch and are checked and answered exactly as `serve` would answer them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import uuid

# The routes a batch line may name (vLLM's run-batch takes chat, completions, embeddings, score and rerank)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/score", "/v1/rerank",
              "/rerank", "/v2/rerank", "/classify")
DEFAULT_MAX_CONCURRENCY = 256
PROGRESS_INTERVAL_S = 10.0


class BatchLineError(Exception):
    """A line that is not a runnable request; answered with an error line."""

    def __init__(self, message: str, custom_id=None):
        super().__init__(message)
        self.custom_id = custom_id


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    url: str
    body: bytes      # the JSON body as the route receives it


def parse_line(text: str) -> BatchRequest:
    """One input line as a request, or BatchLineError saying what is wrong with it."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as e:
        raise BatchLineError(f"not valid JSON: {e}") from None
    if not isinstance(line, dict):
        raise BatchLineError(f"a batch line must be a JSON object, got {type(line).__name__}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError("a batch line needs a non-empty string `custom_id`", custom_id)
    method = line.get("method", "POST")
    if method != "POST":
        raise BatchLineError(f"`method` must be \"POST\", got {method!r}", custom_id)
    url = line.get("url")
    if url not in BATCH_URLS:
        raise BatchLineError(f"`url` must be one of {', '.join(BATCH_URLS)}; got {url!r}", custom_id)
    body = line.get("body")
    if not isinstance(body, dict):
        raise BatchLineError("`body` must be a JSON object (the request the url takes)", custom_id)
    if body.get("stream"):
        raise BatchLineError("`stream` is not supported in a batch: each answer is written whole", custom_id)
    return BatchRequest(custom_id, url, json.dumps(body).encode())


async def call_app(app, path: str, body: bytes) -> tuple[int, str, bytes]:
    """POST `body` to `path` on the ASGI `app` in process: (status, X-Request-Id, response body)."""
    sent = False
    never = asyncio.Event()   # the "client" never disconnects: a handler awaiting that waits until it is done

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()

    status, request_id, chunks = 500, "", []

    async def send(message):
        nonlocal status, request_id
        if message["type"] == "http.response.start":
            status = message["status"]
            request_id = dict(message.get("headers", [])).get(b"x-request-id", b"").decode("ascii")
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 0), "server": ("atlasjax-batch", 0)}
    await app(scope, receive, send)
    return status, request_id, b"".join(chunks)


def output_line(custom_id, status: int | None, request_id: str | None, payload: dict | None) -> dict:
    """The batch output object of one request; `payload` is the route's JSON answer (an error body below 200)."""
    ok = status == 200
    error = None if ok else (payload or {}).get("error", payload)
    return {"id": f"atlasjax-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": None if status is None else {"status_code": status, "request_id": request_id,
                                                     "body": payload if ok else None},
            "error": error}


def line_error(err: BatchLineError) -> dict:
    return output_line(err.custom_id if isinstance(err.custom_id, str) else None, None, None,
                       {"error": {"message": str(err), "type": "invalid_request_error", "param": None,
                                  "code": "invalid_batch_line"}})


@dataclasses.dataclass
class BatchTally:
    lines: int = 0
    answered: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: dict) -> None:
        self.lines += 1
        if out["error"] is None:
            self.answered += 1
            usage = out["response"]["body"].get("usage") or {}
            self.prompt_tokens += usage.get("prompt_tokens") or 0
            self.completion_tokens += usage.get("completion_tokens") or 0
        else:
            self.failed += 1

    def describe(self, seconds: float, total: int) -> str:
        rate = (f", {self.completion_tokens / seconds:,.0f} output tok/s" if seconds > 0 and self.completion_tokens
                else "")
        return (f"{self.lines}/{total} lines in {seconds:.1f} s: {self.answered} answered, {self.failed} failed; "
                f"{self.prompt_tokens:,} prompt + {self.completion_tokens:,} output tokens{rate}")


async def run_lines(app, lines: list[str], write, *, max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                    progress=None) -> BatchTally:
    """Answer every line through `app`, at most `max_concurrency` in flight, started in input order and a new one
    as soon as any ends (a long answer holds up no others); `write(dict)` gets the outputs in input order, each
    as soon as it and those before it are done. `progress(tally)` runs every ~10 s."""
    tally, slots = BatchTally(), asyncio.Semaphore(max_concurrency)   # (its waiters wake in arrival order)
    finished: dict[int, dict] = {}     # answers waiting for one before them
    next_out, last_report = 0, time.monotonic()

    async def answer(text: str) -> dict:
        try:
            request = parse_line(text)
        except BatchLineError as e:
            return line_error(e)
        async with slots:
            status, request_id, raw = await call_app(app, request.url, request.body)
        try:
            payload = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            payload = {"error": {"message": raw.decode(errors="replace"), "type": "server_error"}}
        return output_line(request.custom_id, status, request_id, payload)

    async def answer_in_order(i: int, text: str) -> None:
        nonlocal next_out, last_report
        finished[i] = await answer(text)
        while next_out in finished:
            out = finished.pop(next_out)
            write(out)
            tally.add(out)
            next_out += 1
        if progress is not None and time.monotonic() - last_report >= PROGRESS_INTERVAL_S:
            last_report = time.monotonic()
            progress(tally)

    requests = [text for text in lines if text.strip()]
    await asyncio.gather(*(answer_in_order(i, text) for i, text in enumerate(requests)))
    return tally


def read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def add_batch_args(p) -> None:
    from serving.cli import add_answer_args, add_engine_placement_args  # noqa: PLC0415
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True, metavar="FILE",
                   help="the requests, one OpenAI Batch API line each (- reads standard input)")
    g.add_argument("-o", "--output-file", required=True, metavar="FILE",
                   help="the answers, one line per request in input order (- writes standard output)")
    g.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY, metavar="N",
                   help="requests submitted to the engine at once (default: %(default)s); the engine batches "
                        "--max-num-seqs of them per step and queues the rest")
    add_answer_args(g)
    add_engine_placement_args(g)


def run_batch(args) -> int:
    """The `run-batch` command: 0 when every line has an answer line (failed requests included), 2 on bad flags
    or an unreadable input."""
    from atlasjax.errors import InvalidRequestError  # noqa: PLC0415
    from serving.app import create_app  # noqa: PLC0415
    from serving.cli import build_llm, check_lora_modules, lora_modules_arg, served_model_name  # noqa: PLC0415
    if args.max_concurrency < 1:
        print(f"error: --max-concurrency must be 1 or more, got {args.max_concurrency}", file=sys.stderr)
        return 2
    if args.output_file != "-" and args.input_file != "-" and _same_file(args.input_file, args.output_file):
        print("error: --output-file would overwrite --input-file", file=sys.stderr)
        return 2
    try:
        lora_modules = lora_modules_arg(args)
        lines = read_lines(args.input_file)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum(1 for text in lines if text.strip())
    llm = build_llm(args, max_waiting=args.max_concurrency + 1)
    print(f"atlasjax: {llm.engine.weights_summary}", file=sys.stderr, flush=True)
    try:
        try:
            check_lora_modules(llm, lora_modules, args.max_lora_rank)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        app = create_app(llm, served_model_name=args.served_model_name or served_model_name(args.model),
                         reasoning_parser=args.reasoning_parser,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids, lora_modules=lora_modules)
        out = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")
        start = time.perf_counter()

        def write(obj: dict) -> None:
            out.write(json.dumps(obj, ensure_ascii=False) + "\n")
            out.flush()

        def progress(tally: BatchTally) -> None:
            print(f"atlasjax: run-batch {tally.describe(time.perf_counter() - start, total)}", file=sys.stderr,
                  flush=True)
        try:
            tally = asyncio.run(run_lines(app, lines, write, max_concurrency=args.max_concurrency, progress=progress))
        finally:
            if out is not sys.stdout:
                out.close()
        progress(tally)
    finally:
        llm.shutdown(drain=True, timeout=30.0)
        llm.engine.stop_followers()   # multi-host: the other processes may exit now
    return 0


def _same_file(a: str, b: str) -> bool:
    import os  # noqa: PLC0415
    return os.path.exists(b) and os.path.samefile(a, b)

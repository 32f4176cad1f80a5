"""`serve` mode: a load generator against any OpenAI-compatible server (`/v1/completions`, streaming).

Requests carry random prompts (token ids by default, or random words with --prompt-format text),
optionally behind shared prefixes (--prefix-len, --num-prefixes),
`max_tokens` = the output length and `ignore_eos: true`, and stream with
`stream_options.include_usage`. Load is shaped by `--max-concurrency` (at most that many requests
in flight) and `--request-rate` (Poisson arrivals: exponential gaps of mean 1/rate; inf sends all
at once). Warm-up requests run first and must succeed. Per request:
- TTFT: send -> first streamed chunk with choices;
- ITL: every gap between consecutive chunks with choices;
- E2EL: send -> last chunk with choices;
- TPOT: (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token.
output_tokens is the server's usage.completion_tokens, else the number of chunks with choices.
Run-level: request/s, output tok/s, total tok/s over the time from the first send to the last
answer; failures (HTTP errors, error events, streams without a token) are counted, not timed.
These are the definitions of vLLM's benchmark_serving, implemented here.
"""
from __future__ import annotations

import asyncio
import json
import math
import time

import numpy as np

from atlasjax.bench.presets import PRESETS, progress
from atlasjax.bench.report import fmt, roofline_rows, stats_rows, summarize, table

_WORDS = ("the of and to in is was for on that with as by at from his her an be which or are this had not "
          "but were one all their they have has more time new there when after can first into also").split()


def add_args(p) -> None:
    g = p.add_argument_group("serve")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--model", default=None, help="model name sent to the server (default: the first of /v1/models)")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--max-concurrency", type=int, default=None, help="default: unlimited")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.0)
    g.add_argument("--prompt-format", default="ids", choices=["ids", "text"],
                   help="ids: prompt as a token id list; text: random words (about one token each)")
    g.add_argument("--vocab-size", type=int, default=None, help="random ids below this (default: --preset's, or 512)")
    g.add_argument("--prefix-len", type=int, default=0,
                   help="put one of --num-prefixes shared random prefixes of this many tokens before each prompt's "
                        "own --input-len tokens (each prompt's drawn at random with --seed: vLLM's prefix_repetition "
                        "data, what prefix caching and data-parallel routing are for; default 0: none)")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (with --prefix-len)")
    g.add_argument("--num-warmups", type=int, default=1,
                   help="concurrent warm-up requests (the run's first prompts, at most 16 output tokens)")
    g.add_argument("--no-warmup-buckets", action="store_true",
                   help="skip the sequential warm-up prompts of 15, 31, 63, ... tokens (each compiles a "
                        "prefill bucket on atlasjax's server)")
    g.add_argument("--wait-for-server", type=float, default=0.0, help="seconds to wait for /v1/models to answer")
    g.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout, seconds")
    g.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="the served model's shape, for the roofline (ceilings measured on this machine)")
    g.add_argument("--no-ceilings", action="store_true", help="do not measure device ceilings here")
    g.add_argument("--priority-fraction", type=float, default=0.0,
                   help="this fraction of the requests (drawn with --seed) carry `priority` --priority, and the "
                        "report splits TTFT and E2EL by class (the server needs --scheduling-policy priority)")
    g.add_argument("--priority", type=int, default=-1, help="the priority those requests carry (lower first)")
    g.add_argument("--seed", type=int, default=0)


def make_prompts(args) -> list[tuple[object, int, int]]:
    """[(prompt, prompt_len, output_len)]."""
    from atlasjax.bench.throughput import sample_lengths  # noqa: PLC0415
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts + args.num_warmups
    ins = sample_lengths(rng, n, args.input_len, args.range_ratio)
    outs = sample_lengths(rng, n, args.output_len, args.range_ratio)
    vocab = args.vocab_size or (PRESETS[args.preset].vocab_size if args.preset else 512)

    def draw(length: int) -> list:
        return rng.integers(0, vocab, length).tolist() if args.prompt_format == "ids" else \
            rng.choice(_WORDS, length).tolist()
    prefix_len = getattr(args, "prefix_len", 0)
    prefixes = [draw(prefix_len) for _ in range(max(1, getattr(args, "num_prefixes", 1)))] if prefix_len else [[]]
    which = np.random.default_rng(args.seed + 1).integers(0, len(prefixes), n)   # each prompt's prefix
    prompts = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs)):
        tokens = prefixes[which[i]] + draw(n_in)
        prompts.append((tokens if args.prompt_format == "ids" else " ".join(tokens), prefix_len + n_in, n_out))
    return prompts


async def send(client, url: str, body: dict) -> dict:
    """One streamed completion; returns its timings (or an error)."""
    out = dict(ttft=None, itl=[], e2el=None, output_tokens=None, prompt_tokens=None, error=None, chunks=0)
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out["error"] = f"error event: {str(event['error'])[:300]}"
                    return out
                if event.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        out["ttft"] = now - t0
                    else:
                        out["itl"].append(now - last)
                    last = now
                    out["chunks"] += 1
                if event.get("usage"):
                    out["output_tokens"] = event["usage"].get("completion_tokens")
                    out["prompt_tokens"] = event["usage"].get("prompt_tokens")
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        return out
    if last is None:
        out["error"] = "the stream ended without a token"
        return out
    out["e2el"] = last - t0
    if out["output_tokens"] is None:
        out["output_tokens"] = out["chunks"]
    return out


def _body(model, prompt, n_out, priority: int | None = None) -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=n_out, temperature=0.0, ignore_eos=True, stream=True,
                stream_options=dict(include_usage=True))
    if priority is not None:
        body["priority"] = priority
    return body


def priority_classes(args, num_requests: int) -> list[int | None]:
    """Per timed request: --priority for a seeded --priority-fraction of them, else None (none sent)."""
    if not 0.0 <= args.priority_fraction <= 1.0:
        raise ValueError(f"--priority-fraction must be in [0, 1], got {args.priority_fraction}")
    picked = np.random.default_rng(args.seed + 2).random(num_requests) < args.priority_fraction
    return [args.priority if p else None for p in picked]


async def _resolve_model(client, args) -> str:
    deadline = time.perf_counter() + args.wait_for_server
    while True:
        try:
            r = await client.get(args.base_url.rstrip("/") + "/v1/models", timeout=10)
            if r.status_code == 200:
                return args.model or r.json()["data"][0]["id"]
            if args.model:                       # servers without /v1/models
                return args.model
        except Exception:  # noqa: BLE001
            if time.perf_counter() >= deadline:
                raise
        if time.perf_counter() >= deadline:
            raise SystemExit(f"{args.base_url}/v1/models did not answer 200 within --wait-for-server")
        await asyncio.sleep(1.0)


async def _warm_up(client, url, model, args, warm) -> None:
    """Prompts of 2^k - 1 tokens one at a time, then the concurrent warm-up batch.

    On atlasjax's server each of the first compiles one prefill bucket (2^k tokens), up to what
    `max_concurrency` prompts could fill together; the first length the server rejects (longer
    than its max_model_len) ends them. The batch compiles the decode step under load.
    """
    t = time.perf_counter()
    longest = max(n for _, n, _ in warm) if warm else args.input_len
    reach = min(longest * (args.max_concurrency or args.num_prompts), 32768)
    lengths = [] if args.no_warmup_buckets else [(1 << k) - 1 for k in range(4, 16) if (1 << k) <= 2 * reach]
    vocab = args.vocab_size or (PRESETS[args.preset].vocab_size if args.preset else 512)
    rng, done = np.random.default_rng(args.seed + 2), 0
    for n in lengths:      # random, so no prefix-cache hit shrinks the computed length below the bucket
        prompt = rng.integers(0, vocab, n).tolist() if args.prompt_format == "ids" else \
            " ".join(rng.choice(_WORDS, n).tolist())
        r = await send(client, url, _body(model, prompt, 1))
        if r["error"] and r["error"].startswith("HTTP 400"):
            progress(f"warm-up: the server refused a {n}-token prompt; bucket warm-up ends here")
            break
        if r["error"]:
            raise SystemExit(f"warm-up request ({n} prompt tokens) failed: {r['error']}")
        done += 1
        progress(f"warm-up: {n}-token prompt answered in {r['e2el']:.1f}s")
    for r in await asyncio.gather(*(send(client, url, _body(model, p, min(n, 16))) for p, _, n in warm)):
        if r["error"]:
            raise SystemExit(f"warm-up request failed: {r['error']}")
    progress(f"warm-up done in {time.perf_counter() - t:.1f}s ({done} bucket prompts, {len(warm)} concurrent)")


async def _wait_for_server(args) -> str:
    try:
        import httpx  # noqa: PLC0415
    except ImportError:
        raise SystemExit("the serve mode needs httpx (pip install httpx)") from None
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        model = await _resolve_model(client, args)
    progress(f"server {args.base_url} is up, model {model!r}")
    return model


async def _run_load(args) -> dict:
    import httpx  # noqa: PLC0415
    prompts = make_prompts(args)
    warm, prompts = prompts[:args.num_warmups], prompts[args.num_warmups:]
    url = args.base_url.rstrip("/") + args.endpoint
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0), limits=limits) as client:
        model = args.model
        await _warm_up(client, url, model, args, warm)
        progress(f"sending {len(prompts)} requests "
                 f"(rate {args.request_rate}, max concurrency {args.max_concurrency or 'unlimited'})")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = np.random.default_rng(args.seed + 1)
        state = dict(in_flight=0, peak=0, done=0)
        ranks = priority_classes(args, len(prompts))

        async def limited(p, n, rank):
            if sem:
                await sem.acquire()
            state["in_flight"] += 1
            state["peak"] = max(state["peak"], state["in_flight"])
            try:
                return await send(client, url, _body(model, p, n, rank))
            finally:
                state["in_flight"] -= 1
                state["done"] += 1
                if sem:
                    sem.release()

        t0 = time.perf_counter()
        tasks = []
        for i, (p, _, n) in enumerate(prompts):
            if i and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
            tasks.append(asyncio.create_task(limited(p, n, ranks[i])))
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=10)
            if pending:
                progress(f"{state['done']}/{len(prompts)} done, {state['in_flight']} in flight, "
                         f"{time.perf_counter() - t0:.0f}s")
        duration = time.perf_counter() - t0
    outs = [t.result() for t in tasks]
    return dict(model=model, outs=outs, prompts=prompts, duration=duration, peak_concurrency=state["peak"],
                ranks=ranks)


def metrics(outs, prompts, duration) -> dict:
    ok = [(o, p) for o, p in zip(outs, prompts) if not o["error"]]
    n_in = sum(o["prompt_tokens"] if o["prompt_tokens"] is not None else p[1] for o, p in ok)
    n_out = sum(o["output_tokens"] for o, _ in ok)
    tpot = [(o["e2el"] - o["ttft"]) / (o["output_tokens"] - 1) for o, _ in ok if o["output_tokens"] > 1]
    errors = [o["error"] for o in outs if o["error"]]
    return dict(duration_s=duration, completed=len(ok), failed=len(errors), errors=errors[:10],
                total_input_tokens=n_in, total_output_tokens=n_out,
                request_throughput=len(ok) / duration, output_throughput=n_out / duration,
                total_token_throughput=(n_in + n_out) / duration,
                ttft_s=summarize([o["ttft"] for o, _ in ok]), tpot_s=summarize(tpot),
                itl_s=summarize([g for o, _ in ok for g in o["itl"]]), e2el_s=summarize([o["e2el"] for o, _ in ok]))


def by_priority(outs, prompts, ranks, duration) -> dict:
    """metrics() of each class: "priority P" (the requests that carried P) and "others" (none sent)."""
    classes = {f"priority {r}": r for r in sorted({r for r in ranks if r is not None})}
    classes["others"] = None
    result = {}
    for name, rank in classes.items():
        pairs = [(o, p) for o, p, r in zip(outs, prompts, ranks) if r == rank]
        result[name] = metrics([o for o, _ in pairs], [p for _, p in pairs], duration)
    return result


def run(args) -> tuple[dict, list[str], bool]:
    args.model = asyncio.run(_wait_for_server(args))
    ceilings = None
    if args.preset and not args.no_ceilings:
        from atlasjax.bench.roofline import measure_ceilings  # noqa: PLC0415
        progress("measuring device ceilings on this machine (the server should be idle)")
        try:
            ceilings = measure_ceilings()
        except Exception as e:  # noqa: BLE001 - e.g. no memory left beside the server
            progress(f"could not measure ceilings: {type(e).__name__}: {e}")
    load = asyncio.run(_run_load(args))
    m = metrics(load["outs"], load["prompts"], load["duration"])
    m["peak_concurrency"] = load["peak_concurrency"]
    if args.priority_fraction > 0:
        m["by_priority"] = by_priority(load["outs"], load["prompts"], load["ranks"], load["duration"])
    settings = {k: getattr(args, k) for k in ("base_url", "endpoint", "num_prompts", "max_concurrency",
                                               "input_len", "output_len", "range_ratio", "prompt_format",
                                               "num_warmups", "preset", "seed", "priority_fraction", "priority",
                                               "prefix_len", "num_prefixes")}
    settings.update(model=load["model"], request_rate=args.request_rate if math.isfinite(args.request_rate) else "inf")
    roof = _roofline(args, m, ceilings)
    report = dict(mode="serve", settings=settings, results=m, roofline=roof)
    tables = [_table(args, m), table("roofline", ["figure", "value", "note"], roofline_rows(roof))]
    return report, tables, ceilings is not None


def _roofline(args, m, ceilings) -> dict:
    """With --preset: the bandwidth/compute floor of a decode step at the run's concurrency."""
    if not args.preset:
        return dict(ceilings=None, note="pass --preset NAME (the served shape) for the roofline")
    from atlasjax.bench import roofline  # noqa: PLC0415
    cfg = PRESETS[args.preset]
    batch = min(args.max_concurrency or args.num_prompts, args.num_prompts)
    item = 2 if ceilings is None or ceilings["matmul_dtype"] != "float32" else 4
    w = roofline.estimate_weight_bytes(cfg, item)
    cost = roofline.decode_cost(cfg, w, item, batch, args.prefix_len + args.input_len + args.output_len / 2)
    roof = dict(ceilings=ceilings, decode_step_at_concurrency=cost)
    if ceilings:
        step = roofline.achieved(cost, 1.0, ceilings)["floor_seconds"]
        roof["roofline_output_tokens_per_s"] = batch / step
        roof["frac_roofline_output_throughput"] = m["output_throughput"] * step / batch
    return roof


def _table(args, m) -> str:
    figures = [("TTFT", m["ttft_s"], "ms", 1e3), ("TPOT", m["tpot_s"], "ms", 1e3),
               ("ITL", m["itl_s"], "ms", 1e3), ("E2EL", m["e2el_s"], "ms", 1e3)]
    for name, c in m.get("by_priority", {}).items():
        figures += [(f"TTFT, {name} ({c['completed']})", c["ttft_s"], "ms", 1e3),
                    (f"E2EL, {name} ({c['completed']})", c["e2el_s"], "ms", 1e3)]
    rows = stats_rows(figures, cols=("mean", "median", "p90", "p99"))
    rows += [["request throughput", fmt(m["request_throughput"]), "", "", "", "req/s"],
             ["output token throughput", fmt(m["output_throughput"]), "", "", "", "tok/s"],
             ["total token throughput", fmt(m["total_token_throughput"]), "", "", "", "tok/s"],
             ["completed / failed", f"{m['completed']} / {m['failed']}", "", "", "", ""],
             ["input / output tokens", f"{m['total_input_tokens']} / {m['total_output_tokens']}", "", "", "", ""],
             ["duration", fmt(m["duration_s"]), "", "", "", "s"],
             ["peak concurrency", str(m["peak_concurrency"]), "", "", "", ""]]
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    shared = f" behind {args.num_prefixes} shared prefixes of {args.prefix_len}" if args.prefix_len else ""
    return table(f"serve: {args.num_prompts} prompts, {args.input_len} in{shared} / {args.output_len} out, "
                 f"rate {rate}, "
                 f"max concurrency {args.max_concurrency or 'unlimited'}",
                 ["figure", "mean", "median", "p90", "p99", "unit"], rows)

"""`throughput` mode: N requests submitted at once, the engine run until all finish (offline batch).

Prompts are random token ids with lengths drawn uniformly from
[input_len * (1 - range_ratio), input_len * (1 + range_ratio)] (output lengths likewise), greedy
with ignore_eos so every request makes exactly its output length; or `--dataset` JSONL, one
object a line with "prompt" (text, needs a tokenizer) or "prompt_token_ids", and optionally
"output_len". Before timing, every prefill bucket up to the token budget and the decode step are
compiled by short warm-up requests (compiles during the timed run are counted and reported).
Figures: requests/s, output tok/s, total (prompt + output) tok/s over the timed run.
`--compare-async` then runs the same requests with asynchronous scheduling off and on
(atlasjax.bench.overlap) and reports the time per engine step of each.
"""
from __future__ import annotations

import json
import time

import numpy as np

from atlasjax.bench import overlap, roofline
from atlasjax.bench.presets import args_weights_label, build_engine, progress
from atlasjax.bench.report import fmt, roofline_rows, table


def add_args(p) -> None:
    g = p.add_argument_group("throughput")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1-r) .. len*(1+r)")
    g.add_argument("--dataset", default=None, help="JSONL: {\"prompt\"|\"prompt_token_ids\", \"output_len\"?}")
    g.add_argument("--no-warmup", action="store_true", help="do not precompile the buckets before timing")
    g.add_argument("--compare-async", action="store_true",
                   help="then run the same requests with async scheduling off and on: time per engine step")
    g.add_argument("--compare-repeats", type=int, default=1, help="off/on pairs --compare-async runs (alternating)")


def sample_lengths(rng, n: int, mean: int, range_ratio: float) -> list[int]:
    lo, hi = max(1, int(round(mean * (1 - range_ratio)))), max(1, int(round(mean * (1 + range_ratio))))
    return rng.integers(lo, hi + 1, n).tolist()


def make_requests(args, vocab: int, tokenizer=None) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)]."""
    rng = np.random.default_rng(args.seed)
    if args.dataset:
        reqs = []
        with open(args.dataset) as f:
            for line in f:
                if not line.strip():
                    continue
                d = json.loads(line)
                if "prompt_token_ids" in d:
                    ids = [int(t) for t in d["prompt_token_ids"]]
                else:
                    if tokenizer is None:
                        raise SystemExit("--dataset has text prompts but the model has no tokenizer (a preset): "
                                         "use prompt_token_ids or --model")
                    ids = tokenizer.encode(d["prompt"])
                reqs.append((ids, int(d.get("output_len", args.output_len))))
                if len(reqs) == args.num_prompts:
                    break
        return reqs
    ins = sample_lengths(rng, args.num_prompts, args.input_len, args.range_ratio)
    outs = sample_lengths(rng, args.num_prompts, args.output_len, args.range_ratio)
    return [(rng.integers(0, vocab, n).tolist(), m) for n, m in zip(ins, outs)]


def warm_up(engine, max_prompt: int, num_requests: int) -> None:
    """Compile every step the run can reach: each prefill bucket up to the largest prompt
    step (a bucket larger than one prompt may be reached by several prompts prefilled in one step) and
    the greedy decode steps of every batch bucket up to the run's concurrency, one and K iterations per
    launch. Then run each prefill bucket once with short requests, so that no program's first run is
    timed. (Until session 55 the prefills compiled as those requests reached them, outside the
    compile threads that $ATLASJAX_COMPILE_THREADS sets.)"""
    from atlasjax.sampling import SamplingPlan  # noqa: PLC0415
    from atlasjax.sampling_params import SamplingParams  # noqa: PLC0415
    rng = np.random.default_rng(12345)
    runner, limit = engine.runner, engine.max_model_len - 2
    reach = runner.bucket_for(min(engine.config.max_num_batched_tokens, max_prompt * engine.config.max_num_seqs))
    t = time.perf_counter()
    top = runner.decode_rows_for(min(num_requests, engine.config.max_num_seqs))
    # In the runner's compile threads: one on a GPU once the pool is allocated, unless
    # $ATLASJAX_COMPILE_THREADS says more. Eight (8B, fp8 W8A8, session 55) took 61 s against 111 for
    # prefills up to 1,024 tokens but 365 s against ~355 up to 8,192, and XLA warned that concurrent
    # autotuners time their candidates less accurately.
    runner.warmup(engine.config.num_scheduler_steps, plans=(SamplingPlan(greedy=True, logprobs=False),),
                  max_decode_rows=top, max_prefill_tokens=reach)
    progress(f"warm-up: compiled prefill buckets up to {reach} tokens and greedy decode buckets up to {top} rows "
             f"in {time.perf_counter() - t:.1f}s")
    for b in (b for b in runner.prefill_buckets if b <= reach):
        t = time.perf_counter()
        sizes = [limit] * (b // limit) + ([b % limit] if b % limit else [])
        ids = [f"warmup{b}-{i}" for i in range(len(sizes))][:engine.config.max_num_seqs]
        for rid, n in zip(ids, sizes):
            engine.add_request(rid, rng.integers(0, engine.model_config.vocab_size, n).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        for rid in ids:
            engine.release(rid)
        progress(f"warm-up: prefill bucket {b} (+ decode) ran in {time.perf_counter() - t:.1f}s")


class _CallCounter:
    """Counts the jitted prefill / decode calls (each reads the weights once)."""

    def __init__(self, runner):
        self.calls = 0
        for name in ("prefill", "decode"):
            fn = getattr(runner, name)
            setattr(runner, name, self._wrap(fn))

    def _wrap(self, fn):
        def counted(*a, **k):
            self.calls += 1
            return fn(*a, **k)
        return counted


def run(args, ceilings: dict | None, hf: dict | None) -> tuple[dict, list[str]]:
    from atlasjax.sampling_params import SamplingParams  # noqa: PLC0415
    max_len = args.max_model_len
    if max_len is None and not args.dataset:     # room for the longest random request
        max_len = round(args.input_len * (1 + args.range_ratio)) + round(args.output_len * (1 + args.range_ratio)) + 1
    engine = build_engine(args, max_model_len=max_len)
    reqs = make_requests(args, engine.model_config.vocab_size, engine.tokenizer)
    limit = engine.max_model_len
    reqs = [(p[:limit - 1], min(m, limit - len(p[:limit - 1]))) for p, m in reqs]
    if not args.no_warmup:
        warm_up(engine, max(len(p) for p, _ in reqs), len(reqs))
    runner = engine.runner
    compiles_before, compile_s_before = runner.num_compiles, runner.compile_seconds
    counter = _CallCounter(runner)
    steps_before, preempt_before = engine.stats.num_steps, engine.scheduler.num_preemptions
    progress(f"running {len(reqs)} requests")
    t0 = time.perf_counter()
    for i, (prompt, n_out) in enumerate(reqs):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    seqs = [engine.requests[f"r{i}"][0] for i in range(len(reqs))]
    done, last = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        if time.perf_counter() - last > 5:
            done, last = sum(r.is_finished for r in seqs), time.perf_counter()
            progress(f"{done}/{len(reqs)} finished, {time.perf_counter() - t0:.0f}s")
    elapsed = time.perf_counter() - t0
    n_in = sum(len(p) for p, _ in reqs)
    n_out = sum(len(r.output_token_ids) for r in seqs)
    results = dict(async_scheduling=engine.async_scheduling, elapsed_s=elapsed, num_requests=len(reqs),
                   prompt_tokens=n_in, output_tokens=n_out,
                   requests_per_s=len(reqs) / elapsed, output_tokens_per_s=n_out / elapsed,
                   total_tokens_per_s=(n_in + n_out) / elapsed, num_steps=engine.stats.num_steps - steps_before,
                   num_forward_calls=counter.calls,
                   num_preemptions=engine.scheduler.num_preemptions - preempt_before,
                   num_compiles_while_timed=runner.num_compiles - compiles_before,
                   compile_seconds_while_timed=runner.compile_seconds - compile_s_before,
                   num_compiles=runner.num_compiles, compile_seconds=runner.compile_seconds)
    roof = _roofline(engine, reqs, seqs, counter.calls, elapsed, ceilings)
    settings = dict(model=engine.loaded.source, num_prompts=len(reqs), input_len=args.input_len,
                    output_len=args.output_len, range_ratio=args.range_ratio, dataset=args.dataset,
                    dtype=str(np.dtype(engine.dtype)), quantization=args.quantization,
                    quantize_lm_head=args.quantize_lm_head, weights=engine.weights_summary,
                    engine=_asdict(engine.config), model_config=_asdict(engine.model_config))
    report = dict(mode="throughput", settings=settings, results=results, roofline=roof)
    label = args_weights_label(args)
    tables = [_table(results, f"{engine.loaded.source} {label or np.dtype(engine.dtype).name}")]
    if hf:
        ratio = (results["output_tokens_per_s"] / hf["output_tokens_per_s"]) if hf.get("output_tokens_per_s") else None
        report["compare"] = dict(hf=hf, output_tokens_per_s_ratio=ratio)
        tables.append(table(f"vs Hugging Face transformers {hf.get('transformers')} ({hf.get('mode')}; fixed "
                            f"lengths, batches of {hf.get('batch_size')})", ["figure", "atlasjax", "hf", "atlasjax / hf"],
                            [["output tok/s", fmt(results["output_tokens_per_s"]), fmt(hf.get("output_tokens_per_s")),
                              fmt(ratio, "x")]]))
    tables.append(table("roofline (whole timed run)", ["figure", "value", "note"], roofline_rows(roof)))
    if args.compare_async:
        report["compare_async"] = overlap.compare(engine, reqs, args.compare_repeats)
        tables.append(overlap.compare_table(report["compare_async"], f"{len(reqs)} requests, "
                                            f"max_num_seqs {engine.config.max_num_seqs}"))
    return report, tables


def _asdict(x):
    import dataclasses  # noqa: PLC0415
    return dataclasses.asdict(x)


def _roofline(engine, reqs, seqs, num_calls, elapsed, ceilings) -> dict:
    """Whole-run lower bounds: weights once per jitted call, each token's KV read at its context."""
    cfg, item = engine.model_config, np.dtype(engine.dtype).itemsize
    w = roofline.weight_bytes_per_step(engine.runner.params, cfg, engine.config.max_num_seqs, item)
    pre = roofline.prefill_cost(cfg, 0, item, [len(p) for p, _ in reqs])
    kv_read = flops_dec = 0.0
    for (prompt, _), req in zip(reqs, seqs):
        n_dec = max(0, len(req.output_token_ids) - 1)           # tokens made by decode steps
        ctx_sum = n_dec * len(prompt) + n_dec * (n_dec + 1) / 2
        kv_read += ctx_sum * roofline.kv_bytes_per_token(cfg, item)
        flops_dec += n_dec * roofline.decode_cost(cfg, 0, item, 1, 0)["flops"] \
            + 4 * ctx_sum * cfg.num_layers * cfg.num_heads * cfg.head_dim
    cost = dict(weight_bytes=int(w * num_calls), kv_bytes=int(kv_read + pre["kv_bytes"]),
                bytes=int(w * num_calls + kv_read + pre["kv_bytes"]), flops=pre["flops"] + flops_dec,
                num_forward_calls=num_calls)
    return dict(ceilings=ceilings, run=roofline.achieved(cost, elapsed, ceilings, engine.config.tensor_parallel_size))


def _table(r, label: str) -> str:
    rows = [["requests/s", fmt(r["requests_per_s"])], ["output tok/s", fmt(r["output_tokens_per_s"])],
            ["total tok/s (prompt + output)", fmt(r["total_tokens_per_s"])],
            ["requests", str(r["num_requests"])], ["prompt / output tokens", f"{r['prompt_tokens']} / {r['output_tokens']}"],
            ["elapsed", fmt(r["elapsed_s"], " s")], ["engine steps / forward calls", f"{r['num_steps']} / {r['num_forward_calls']}"],
            ["preemptions", str(r["num_preemptions"])],
            ["compiles while timed", f"{r['num_compiles_while_timed']} ({fmt(r['compile_seconds_while_timed'], ' s')})"]]
    return table(f"throughput: {label}", ["figure", "value"], rows)

"""`latency` mode: one fixed batch through the engine, timed step by step.

Each iteration submits `batch_size` requests of `input_len` random prompt tokens (greedy unless
--temperature says otherwise, no logprobs unless --logprobs asks, ignore_eos, exactly `output_len` new tokens) and drives `engine.step()` until they finish.
Each step reads its sampled tokens back to the host, so host clocks around a step time it fully.
- TTFT: from the first step to the end of the step that gave the last request its first token
  (the prefill step or steps, with admission);
- TPOT: each pure decode step (every request has a token already) divided by the tokens it gave
  each request: one, or up to K with `--num-scheduler-steps K` (K decode iterations per launch);
- decode tok/s: batch_size / TPOT; end-to-end latency and output tok/s per iteration;
- per decode step, the time the engine thread spent blocked reading outputs back (waiting for the
  device) and the rest (host work: scheduling, packing, issuing the step's computation, reading
  results). A wait near zero means the step is host-bound: the device finished before the host
  asked, so faster kernels would not shorten it.
Warm-up iterations run the same shapes first, so every compile happens before timing.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import time

import numpy as np

from atlasjax.bench import roofline
from atlasjax.bench.presets import args_weights_label, build_engine, progress, weights_label
from atlasjax.bench.report import fmt, roofline_rows, stats_rows, summarize, table
from atlasjax.engine_config import GROUPED_FORMATS


def add_args(p) -> None:
    g = p.add_argument_group("latency")
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--num-iters", type=int, default=5)
    g.add_argument("--num-warmup", type=int, default=1)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (the fast argmax plan); above 0 every step runs the full sampling plan "
                        "(penalties, bias, top-k / top-p / min-p filtering and a seeded draw)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="every request asks for the logprobs of its tokens and the K likeliest (default: none), "
                        "which the sampling then computes")
    g.add_argument("--compare-quantization", default=None, metavar="Q[,Q...]",
                   help="after the main run, the same shapes with each of these weight formats (int8, fp8, "
                        "int4, gguf-q4_k_m, gguf-q8_0, gguf-q4_0, none) in this process, one after the other; "
                        "prints each TTFT / TPOT and its ratio to the main run (--quantize-lm-head applies "
                        "to int8, fp8 and int4; a gguf-* layout quantizes its LM head as the file type does)")


def engine_overrides(args) -> dict:
    """Latency defaults: slots = batch, KV pool and max_model_len sized to the batch, prefill in one step."""
    bs, total = args.batch_size, args.input_len + args.output_len
    max_len = args.max_model_len or total
    pages = -(-max_len // args.page_size)
    return dict(max_num_seqs=args.max_num_seqs or bs, max_model_len=max_len,
                num_pages=args.num_pages or bs * pages + 1,
                max_num_batched_tokens=args.max_num_batched_tokens or max(16, min(bs * args.input_len, 16384)))


def _iteration(engine, args, rng, tag: str) -> dict:
    from atlasjax.sampling_params import SamplingParams  # noqa: PLC0415
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            logprobs=getattr(args, "logprobs", None), max_tokens=args.output_len, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [f"{tag}-{b}" for b in range(args.batch_size)]
    for rid in ids:
        engine.add_request(rid, rng.integers(0, vocab, args.input_len).tolist(), params)
    reqs = [engine.requests[rid][0] for rid in ids]

    def num_out():
        return sum(len(r.output_token_ids) for r in reqs)

    ttft, decode_steps, decode_waits, num_steps = None, [], [], 0  # decode figures: per output token
    t0 = time.perf_counter()
    while engine.has_unfinished():
        is_decode = all(r.output_token_ids for r in reqs)
        wait0, out0 = engine.stats.read_wait_seconds, num_out()
        ts = time.perf_counter()
        engine.step()
        te = time.perf_counter()
        num_steps += 1
        if is_decode:   # per token: a multi-step launch gives each request several
            per_row = max(1.0, (num_out() - out0) / len(reqs))
            decode_steps.append((te - ts) / per_row)
            decode_waits.append((engine.stats.read_wait_seconds - wait0) / per_row)
        elif ttft is None and all(r.output_token_ids for r in reqs):
            ttft = te - t0
    e2e = time.perf_counter() - t0
    num_out = sum(len(r.output_token_ids) for r in reqs)
    for rid in ids:
        engine.release(rid)
    return dict(ttft=ttft, decode_steps=decode_steps, decode_waits=decode_waits, e2e=e2e, num_output_tokens=num_out,
                num_steps=num_steps)


def run(args, ceilings: dict | None, hf: dict | None) -> tuple[dict, list[str]]:
    formats = compare_formats(args)
    report, tables = _run_one(args, ceilings, hf)
    if formats:
        lm_head = args.quantize_lm_head
        acts = args.activation_quantization
        runs = [(args_weights_label(args) or "none", report["results"])]
        for q in formats:
            gc.collect()   # the previous engine's params and KV pool leave the device first
            sub = copy.copy(args)
            sub.quantization = None if q == "none" else q
            sub.quantize_lm_head = lm_head and q != "none"
            # the group settings go where the format takes them (int4; int8 the group size; never fp8 or bf16)
            sub.quantization_group_size = args.quantization_group_size if q in GROUPED_FORMATS else None
            sub.quantization_symmetric = args.quantization_symmetric if q == "int4" else None
            sub.activation_quantization = acts if q == acts else None   # fp8 (int8) activations multiply fp8 (int8) weights
            label = weights_label(sub.quantization, sub.quantize_lm_head, sub.activation_quantization) or "none"
            progress(f"--compare-quantization: {label}")
            rep_q, _ = _run_one(sub, ceilings, None)
            runs.append((label, rep_q["results"]))
        report["compare_quantization"] = _quantization_rows(runs)
        tables.insert(1, _quantization_table(args, report["compare_quantization"]))
    return report, tables


def compare_formats(args) -> list[str]:
    if not args.compare_quantization:
        return []
    from atlasjax.bench.gguf_layouts import LAYOUTS  # noqa: PLC0415
    from atlasjax.quantization import FORMATS  # noqa: PLC0415
    known = (*FORMATS, *LAYOUTS, "none")
    formats = [q.strip() for q in args.compare_quantization.split(",") if q.strip()]
    bad = [q for q in formats if q not in known]
    if bad:
        raise SystemExit(f"--compare-quantization: unknown {bad}; choose from {', '.join(known)}")
    return formats


def _quantization_rows(runs) -> list[dict]:
    base_ttft, base_tpot = runs[0][1]["ttft_s"]["median"], runs[0][1]["tpot_s"]["median"]
    return [dict(quantization=q, ttft_s=r["ttft_s"]["median"], tpot_s=r["tpot_s"]["median"],
                 tpot_p10_s=r["tpot_s"]["p10"], ttft_vs_main=r["ttft_s"]["median"] / base_ttft,
                 tpot_vs_main=r["tpot_s"]["median"] / base_tpot) for q, r in runs]


def _quantization_table(args, rows) -> str:
    body = [[r["quantization"], fmt(r["ttft_s"] * 1e3), f"{r['ttft_vs_main']:.2f}x", fmt(r["tpot_s"] * 1e3),
             fmt(r["tpot_p10_s"] * 1e3), f"{r['tpot_vs_main']:.2f}x"] for r in rows]
    return table(f"weight formats, same shapes, one process (batch {args.batch_size}, {args.input_len} in / "
                 f"{args.output_len} out; medians)",
                 ["weights", "TTFT ms", "vs main", "TPOT ms", "TPOT p10 ms", "vs main"], body)


def _run_one(args, ceilings: dict | None, hf: dict | None) -> tuple[dict, list[str]]:
    engine = build_engine(args, **engine_overrides(args))
    rng = np.random.default_rng(args.seed)
    runner = engine.runner
    for i in range(args.num_warmup):
        t = time.perf_counter()
        _iteration(engine, args, rng, f"warmup{i}")
        progress(f"warm-up {i + 1}/{args.num_warmup}: {time.perf_counter() - t:.1f}s "
                 f"({runner.num_compiles} compiles, {runner.compile_seconds:.1f}s; "
                 f"{runner.num_loaded} loaded from the program store)")
    compiles_before = runner.num_compiles
    spec0 = dataclasses.replace(engine.stats.spec)
    iters = []
    for i in range(args.num_iters):
        it = _iteration(engine, args, rng, f"iter{i}")
        iters.append(it)
        tpot = np.median(it["decode_steps"]) if it["decode_steps"] else float("nan")
        progress(f"iteration {i + 1}/{args.num_iters}: TTFT {it['ttft'] * 1e3:.1f} ms, "
                 f"TPOT {tpot * 1e3:.2f} ms, e2e {it['e2e']:.2f}s")
    bs = args.batch_size
    steps = [s for it in iters for s in it["decode_steps"]]
    waits = [w for it in iters for w in it["decode_waits"]]
    results = dict(
        ttft_s=summarize([it["ttft"] for it in iters]),
        tpot_s=summarize(steps),
        decode_tokens_per_s=summarize([bs / s for s in steps]),
        decode_wait_s=summarize(waits),
        decode_host_s=summarize([s - w for s, w in zip(steps, waits)]),
        e2e_latency_s=summarize([it["e2e"] for it in iters]),
        output_tokens_per_s=summarize([it["num_output_tokens"] / it["e2e"] for it in iters]),
        num_decode_steps=len(steps), decode_rows=runner.decode_rows_for(bs),
        num_compiles_while_timed=runner.num_compiles - compiles_before,
        num_compiles=runner.num_compiles, compile_seconds=runner.compile_seconds,
        num_programs_loaded=runner.num_loaded)
    if engine.speculative is not None:   # the timed iterations' drafts
        spec = engine.stats.spec
        drafts, tokens = spec.num_drafts - spec0.num_drafts, spec.num_draft_tokens - spec0.num_draft_tokens
        accepted = spec.num_accepted_tokens - spec0.num_accepted_tokens
        results["speculative"] = dict(num_drafts=drafts, num_draft_tokens=tokens, num_accepted_tokens=accepted,
                                      acceptance_rate=accepted / tokens if tokens else 0.0,
                                      mean_acceptance_length=1 + accepted / drafts if drafts else 0.0)
    roof = _roofline(engine, args, results, ceilings)
    report = dict(mode="latency", settings=_settings(engine, args), results=results, roofline=roof)
    tables = [_table(args, results, _label(engine, args))]
    if hf:
        report["compare"] = _compare(results, hf)
        tables.append(_compare_table(report["compare"]))
    tables.append(table("roofline", ["figure", "value", "note"], roofline_rows(roof)))
    return report, tables


def _settings(engine, args) -> dict:
    return dict(model=engine.loaded.source, batch_size=args.batch_size, input_len=args.input_len,
                output_len=args.output_len, num_iters=args.num_iters, num_warmup=args.num_warmup,
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                dtype=str(np.dtype(engine.dtype)), quantization=args.quantization,
                quantize_lm_head=args.quantize_lm_head, weights=engine.weights_summary,
                engine=dataclasses.asdict(engine.config), model_config=dataclasses.asdict(engine.model_config))


def _roofline(engine, args, results, ceilings) -> dict:
    cfg, bs = engine.model_config, args.batch_size
    item = np.dtype(engine.dtype).itemsize
    w = roofline.weight_bytes_per_step(engine.runner.params, cfg, bs, item)
    ctx = args.input_len + args.output_len / 2            # mean context over the decode steps
    roof = dict(ceilings=ceilings)
    devices = engine.config.tensor_parallel_size
    roof["decode_step"] = roofline.achieved(roofline.decode_cost(cfg, w, item, bs, ctx),
                                            results["tpot_s"]["median"], ceilings, devices)
    roof["prefill"] = roofline.achieved(roofline.prefill_cost(cfg, w, item, [args.input_len] * bs),
                                        results["ttft_s"]["median"], ceilings, devices)
    return roof


def _label(engine, args) -> str:
    label = args_weights_label(args)
    return f"{engine.loaded.source} {label or np.dtype(engine.dtype).name}"


def _table(args, r, label: str) -> str:
    rows = stats_rows([("TTFT", r["ttft_s"], "ms", 1e3), ("TPOT (per output token)", r["tpot_s"], "ms", 1e3),
                       ("decode tok/s (batch / TPOT)", r["decode_tokens_per_s"], "tok/s", 1),
                       ("  host work per token", r["decode_host_s"], "ms", 1e3),
                       ("  waiting for the device per token", r["decode_wait_s"], "ms", 1e3),
                       ("end-to-end latency", r["e2e_latency_s"], "s", 1),
                       ("output tok/s (end to end)", r["output_tokens_per_s"], "tok/s", 1)],
                      cols=("median", "p10", "p90", "mean"))
    if spec := r.get("speculative"):
        rows.append(["drafts accepted", f"{100 * spec['acceptance_rate']:.1f}", "", "", "",
                     f"% of {spec['num_draft_tokens']} (mean acceptance length {spec['mean_acceptance_length']:.2f})"])
    title = (f"latency: {label}, batch {args.batch_size}, {args.input_len} in / {args.output_len} out, "
             f"{args.num_iters} iterations ({r['num_decode_steps']} decode steps; decode rows {r['decode_rows']})")
    return table(title, ["figure", "median", "p10", "p90", "mean", "unit"], rows)


def _compare(r, hf: dict) -> dict:
    def ratio(a, b):
        return a / b if a and b else None
    ours_tpot, ours_ttft = r["tpot_s"]["median"], r["ttft_s"]["median"]
    return dict(hf=hf, tpot_speedup=ratio(hf.get("tpot_s"), ours_tpot),
                ttft_speedup=ratio(hf.get("ttft_s"), ours_ttft),
                atlasjax_tpot_s=ours_tpot, atlasjax_ttft_s=ours_ttft)


def _compare_table(c) -> str:
    hf = c["hf"]
    rows = [["TTFT", fmt(c["atlasjax_ttft_s"], "", 1e3), fmt(hf.get("ttft_s"), "", 1e3),
             fmt(c["ttft_speedup"], "x")],
            ["TPOT", fmt(c["atlasjax_tpot_s"], "", 1e3), fmt(hf.get("tpot_s"), "", 1e3),
             fmt(c["tpot_speedup"], "x")]]
    return table(f"vs Hugging Face transformers {hf.get('transformers')} ({hf.get('mode')}), ms",
                 ["figure", "atlasjax", "hf", "hf / atlasjax"], rows)

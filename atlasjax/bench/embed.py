"""`embed` mode: N inputs through `LLMEngine.embed` in one call (what one /v1/embeddings request of N inputs, or
N concurrent ones, costs the engine): inputs/s, tokens/s, and the fraction of the matmul roofline. The
engine is a pooling runner (`serve --runner pooling`); `--max-num-batched-tokens` above 8,192 (on a GPU)
raises the tokens per batch.

Inputs are random token ids with lengths uniform in input_len * (1 -/+ range_ratio). A first pass compiles
every batch shape (counted apart); then `--num-iters` timed passes over the same inputs (median, best).
The FLOPs are the projections' and attention's of each input at its own length (no LM head: embeddings pool
the hidden states); the padding each batch adds (to a power of two of tokens) is counted as waste, not work.
"""
from __future__ import annotations

import time

import numpy as np

from atlasjax.bench import roofline
from atlasjax.bench.presets import args_weights_label, build_engine, progress
from atlasjax.bench.report import fmt, roofline_rows, table
from atlasjax.bench.throughput import sample_lengths
from atlasjax.embedding import batch_tokens, plan_batches


def add_args(p) -> None:
    g = p.add_argument_group("embed")
    g.add_argument("--num-prompts", type=int, default=256)
    g.add_argument("--input-len", type=int, default=256)
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1-r) .. len*(1+r)")
    g.add_argument("--num-iters", type=int, default=5, help="timed passes (after one that compiles)")


def run(args, ceilings) -> tuple[dict, list[str]]:
    engine = build_engine(args, max_num_seqs=args.max_num_seqs or 8, runner="pooling")   # as `serve --runner pooling`
    cfg = engine.model_config
    rng = np.random.default_rng(args.seed)
    lengths = sample_lengths(rng, args.num_prompts, args.input_len, args.range_ratio)
    limit = engine.max_model_len
    inputs = [rng.integers(0, cfg.vocab_size, min(n, limit)).tolist() for n in lengths]
    progress(f"compiling: {len(inputs)} inputs of {args.input_len} tokens (range {args.range_ratio})")
    t0 = time.perf_counter()
    engine.embed(inputs)
    first = time.perf_counter() - t0
    embedder = engine.embedder
    batches, programs = len(_plan(embedder, inputs)), embedder.num_programs
    times = []
    for i in range(args.num_iters):
        t0 = time.perf_counter()
        engine.embed(inputs)
        times.append(time.perf_counter() - t0)
        progress(f"pass {i + 1}/{args.num_iters}: {times[-1] * 1e3:.1f} ms")
    median, best = float(np.median(times)), min(times)
    tokens = sum(len(t) for t in inputs)
    attn = 2 * float(sum(n * n for n in map(len, inputs))) * cfg.num_layers * cfg.num_heads * cfg.head_dim
    flops = 2 * tokens * roofline._projection_params(cfg) + attn
    padded = sum(batch_tokens(sum(len(inputs[i]) for i in b), embedder.token_budget) for b in _plan(embedder, inputs))
    item = np.dtype(engine.dtype).itemsize
    weights = roofline.weight_bytes_per_step(engine.runner.params, cfg, 1, item) * batches   # once per batch
    kv = tokens * roofline.kv_bytes_per_token(cfg, np.dtype(engine.kv_dtype).itemsize)      # written, then read
    cost = dict(tokens=tokens, weight_bytes=int(weights), kv_bytes=int(kv), bytes=int(weights + kv), flops=flops)
    results = dict(num_inputs=len(inputs), tokens=tokens, padded_tokens=padded, batches_per_pass=batches,
                   first_pass_s=first, median_s=median, best_s=best, inputs_per_s=len(inputs) / median,
                   tokens_per_s=tokens / median, num_programs=embedder.num_programs,
                   num_compiles_while_timed=embedder.num_programs - programs,
                   pooler=engine.pooler.describe())
    roof = dict(ceilings=ceilings, run=roofline.achieved(cost, median, ceilings, engine.config.tensor_parallel_size))
    settings = dict(model=engine.loaded.source, num_prompts=len(inputs), input_len=args.input_len,
                    range_ratio=args.range_ratio, num_iters=args.num_iters, dtype=str(np.dtype(engine.dtype)),
                    weights=engine.weights_summary, token_budget=embedder.token_budget)
    label = args_weights_label(args) or np.dtype(engine.dtype).name
    rows = [["inputs/s", fmt(results["inputs_per_s"])], ["tokens/s", fmt(results["tokens_per_s"])],
            ["pass (median / best)", f"{fmt(median * 1e3, ' ms')} / {fmt(best * 1e3, ' ms')}"],
            ["inputs / tokens (padded)", f"{len(inputs)} / {tokens} ({padded})"],
            ["batches per pass / programs", f"{batches} / {embedder.num_programs}"],
            ["first pass (compiles)", fmt(first, " s")], ["pooling", results["pooler"]]]
    tables = [table(f"embed: {engine.loaded.source} {label}", ["figure", "value"], rows),
              table("roofline (median pass)", ["figure", "value", "note"], roofline_rows(roof))]
    return dict(mode="embed", settings=settings, results=results, roofline=roof), tables


def _plan(embedder, inputs):
    return plan_batches([len(t) for t in inputs], embedder.token_budget)

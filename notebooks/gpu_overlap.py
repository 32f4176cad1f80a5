"""Time per engine step with asynchronous scheduling off vs on: Llama-3.1-8B shapes, random weights.

For each batch size (default 1, 8, 32): an engine with max_num_seqs = batch, `batch` requests of
--input-len random prompt tokens and --output-len new tokens (greedy, ignore_eos) submitted at
once, run with async scheduling off and on alternately (atlasjax.bench.overlap.compare) after a
short warm-up that compiles every shape. Also times the decode step dispatched back to back with
no host work in between: the floor an overlapped engine step can reach. Prints one JSON summary
and writes it to $OUT/gpu_overlap.json when OUT is set (after each batch size).

GPU (from the repo root):   PYTHONPATH=. python3 notebooks/gpu_overlap.py
CPU check (about a minute): PYTHONPATH=. python3 notebooks/gpu_overlap.py --preset tiny --output-len 16
"""
import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from atlasjax.bench.overlap import compare
from atlasjax.bench.presets import PRESETS, load_preset
from atlasjax.engine import LLMEngine, resolve_dtype
from atlasjax.engine_config import EngineConfig
from atlasjax.sampling import pack_rows
from atlasjax.sampling_params import SamplingParams


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="off/on pairs per batch size")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "reference"])
    return p.parse_args()


def make_engine(loaded, args, bs: int) -> LLMEngine:
    max_len = args.input_len + args.output_len
    pages = -(-max_len // 16)
    return LLMEngine(EngineConfig(num_scheduler_steps=1, dtype=args.dtype, max_num_seqs=bs, max_model_len=max_len,
                                  page_size=16,
                                  num_pages=bs * pages + 1, max_num_batched_tokens=max(16, min(bs * args.input_len, 4096)),
                                  attention_backend=args.attention_backend), loaded=loaded)


def device_step_s(engine, bs: int, ctx: int, iters: int = 30) -> float:
    """The decode step alone, dispatched back to back (inputs as the engine passes them, no read-back)."""
    r, s = engine.runner, engine.num_slots
    pps = -(-ctx // 16)
    tokens, lens = np.ones(s, np.int32), np.zeros(s, np.int32)
    pt = np.zeros((s, r.pages_per_seq), np.int32)
    for i in range(bs):
        pt[i, :pps], lens[i] = np.arange(i * pps, (i + 1) * pps), ctx
    f, ii = pack_rows([(SamplingParams(temperature=0), 0, 0, ())] * bs, s)
    jax.block_until_ready(r.decode(tokens, pt, lens, f, ii))
    t = time.perf_counter()
    for _ in range(iters):
        out = r.decode(tokens, pt, lens, f, ii)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters


def main() -> int:
    args = parse_args()
    out_dir = os.environ.get("OUT")
    res = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
               preset=args.preset, input_len=args.input_len, output_len=args.output_len, repeats=args.repeats,
               dtype=args.dtype, attention_backend=args.attention_backend, results={})

    def dump():
        text = json.dumps(res, indent=1)
        if out_dir:
            with open(os.path.join(out_dir, "gpu_overlap.json"), "w") as fh:
                fh.write(text)
        return text

    t = time.perf_counter()
    loaded = load_preset(args.preset, resolve_dtype(args.dtype))
    jax.block_until_ready(loaded.params)
    print(f"{args.preset} weights built in {time.perf_counter() - t:.1f}s on {res['device']}", file=sys.stderr)
    vocab = loaded.config.vocab_size
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        engine = make_engine(loaded, args, bs)
        rng = np.random.default_rng(bs)
        reqs = [(rng.integers(0, vocab, args.input_len).tolist(), args.output_len) for _ in range(bs)]
        t = time.perf_counter()
        compare(engine, [(p, 2) for p, _ in reqs])            # warm-up: compiles prefill, decode, admit
        print(f"bs {bs}: warm-up {time.perf_counter() - t:.1f}s ({engine.runner.num_compiles} compiles)",
              file=sys.stderr, flush=True)
        compiles = engine.runner.num_compiles
        c = compare(engine, reqs, args.repeats)
        c["summary"]["device_step_s"] = device_step_s(engine, bs, args.input_len + args.output_len // 2)
        c["summary"]["compiles_while_timed"] = engine.runner.num_compiles - compiles
        res["results"][f"bs{bs}"] = c
        s = c["summary"]
        print(f"bs {bs}: step {s['mean_step_s_off'] * 1e3:.2f} ms (off) -> {s['mean_step_s_on'] * 1e3:.2f} ms (on); "
              f"device step alone {s['device_step_s'] * 1e3:.2f} ms; outputs identical: {s['outputs_identical']}",
              file=sys.stderr, flush=True)
        dump()
        del engine
    print(json.dumps({k: v["summary"] for k, v in res["results"].items()}, indent=1))
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())

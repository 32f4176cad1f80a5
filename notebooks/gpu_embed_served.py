"""Concurrent /v1/embeddings requests against a running server: requests/s, inputs/s and latency percentiles.

    python notebooks/gpu_embed_served.py URL --concurrency 64 --requests 512 --inputs 1 --input-len 256

Each request embeds `--inputs` random token-id inputs of `--input-len` tokens (vocabulary `--vocab`); a
pooling server runs the requests it finds waiting together (atlasjax/async_llm.py `apply_commands`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--inputs", type=int, default=1)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151669)
    p.add_argument("--encoding-format", default="float", choices=["float", "base64"])
    p.add_argument("--output", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    bodies = [{"input": [[rng.randrange(args.vocab) for _ in range(args.input_len)] for _ in range(args.inputs)],
               "encoding_format": args.encoding_format} for _ in range(args.requests)]
    latencies, queue = [], asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)

    async def worker(client):
        while not queue.empty():
            body = queue.get_nowait()
            t0 = time.perf_counter()
            r = await client.post("/v1/embeddings", json=body)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as client:
        await client.post("/v1/embeddings", json=bodies[0])       # warm
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
    latencies.sort()
    pct = {q: latencies[min(len(latencies) - 1, int(q / 100 * len(latencies)))] * 1e3 for q in (50, 90, 99)}
    result = dict(vars(args), elapsed_s=elapsed, requests_per_s=args.requests / elapsed,
                  inputs_per_s=args.requests * args.inputs / elapsed,
                  tokens_per_s=args.requests * args.inputs * args.input_len / elapsed,
                  latency_ms_p50=pct[50], latency_ms_p90=pct[90], latency_ms_p99=pct[99])
    print(json.dumps(result, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())

"""GPU: KV cache offloading (`kv_offloading_size`) on Llama-3.1-8B shapes (random bf16 weights over MODEL's
config.json): DOCS documents of DOC_LEN random tokens are read once (one token each), which overflows a device
pool of POOL_DOCS documents' pages; then each is asked again (prompt = document + 8 more tokens, one token
out). Without offloading the second read computes the whole document again; with it, the pages come back
from host memory. Reports the second read's latency per request (median, p90), its total, and the first
read's total (what saving the evicted pages costs), as JSON lines on stdout.

    MODEL=.cache/llama8b DOCS=16 DOC_LEN=4096 POOL_DOCS=4 python notebooks/gpu_kv_offload.py
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from atlasjax import LLM, SamplingParams

MODEL = os.environ.get("MODEL", ".cache/llama8b")
DOCS = int(os.environ.get("DOCS", 16))
DOC_LEN = int(os.environ.get("DOC_LEN", 4096))
POOL_DOCS = int(os.environ.get("POOL_DOCS", 4))
PAGE = 16


def main() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 128000, DOC_LEN).tolist() for _ in range(DOCS)]
    again = [d + rng.integers(0, 128000, 8).tolist() for d in docs]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    page_bytes = 32 * 2 * 8 * PAGE * 128 * 2                   # 8B: layers, K and V, KV heads, page, dim, bf16
    host_gib = 1.25 * DOCS * (DOC_LEN // PAGE + 1) * page_bytes / 2**30
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("atlasjax.compile").setLevel(logging.WARNING)
    for offload in [round(host_gib, 2)] if os.environ.get("ONLY_OFFLOAD") else [None, round(host_gib, 2)]:
        llm = LLM(MODEL, load_format="dummy", max_num_seqs=8, max_model_len=DOC_LEN + 64,
                  max_num_batched_tokens=2048, num_pages=POOL_DOCS * (DOC_LEN // PAGE + 4),
                  kv_offloading_size=offload)
        if llm.engine.kv_offload is not None:
            llm.engine.kv_offload.warmup(llm.engine.runner)                   # what serve's start compiles
        llm.generate([{"prompt_token_ids": d} for d in docs[:2]], one)          # warm: compiles
        llm.generate({"prompt_token_ids": again[0]}, one)
        if os.environ.get("WARM_CYCLE"):    # and one whole cycle: read past the pool, then the first again
            for d in docs[:POOL_DOCS + 2]:
                llm.generate({"prompt_token_ids": d}, one)
            llm.generate({"prompt_token_ids": again[0]}, one)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        for d in docs:
            llm.generate({"prompt_token_ids": d}, one)
        first = time.perf_counter() - t0
        seconds, cached = [], []
        for d in again:
            t = time.perf_counter()
            out = llm.generate({"prompt_token_ids": d}, one)[0]
            seconds.append(time.perf_counter() - t)
            cached.append(out.num_cached_tokens)
        stats = llm.engine.stats
        print(json.dumps({"kv_offloading_size_gib": offload, "docs": DOCS, "doc_len": DOC_LEN,
                          "pool_pages": llm.engine.pool.num_pages, "first_read_s": round(first, 3),
                          "second_read_s": round(sum(seconds), 3),
                          "second_read_median_ms": round(1e3 * float(np.median(seconds)), 1),
                          "second_read_p90_ms": round(1e3 * float(np.percentile(seconds, 90)), 1),
                          "second_read_max_ms": round(1e3 * max(seconds), 1),
                          "second_read_slowest": sorted(range(len(seconds)), key=seconds.__getitem__)[-4:],
                          "cached_tokens_median": int(np.median(cached)),
                          "offload_hits": stats.kv_offload_hits, "offload_saved": stats.kv_offload_saved}),
              flush=True)
        del llm


if __name__ == "__main__":
    main()

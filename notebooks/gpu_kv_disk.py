"""GPU: KV offloading to disk (`kv_offloading_disk`) on Llama-3.1-8B shapes (random bf16 weights over MODEL's
config.json, seed 0). DOCS documents of DOC_LEN random tokens are read once (one token out each) by an engine
whose device pool holds POOL_DOCS documents and whose host tier holds HOST_DOCS: their pages go to host memory
and, written through, to files under DISK. Then:
- the same engine asks each again (document + 8 tokens): pages come back from host memory or from the files;
- a new engine (a restart) asks each again: every page comes from the files (in the OS page cache);
- a third engine does the same after the files were dropped from the page cache (posix_fadvise DONTNEED): a
  cold read from the disk.
Reports per phase the latency per request (median, p90, max) and cached tokens, as JSON lines on stdout; the
first phase's reads compute every document (the cost of computing one again).

    MODEL=.cache/llama8b DOCS=32 DOC_LEN=1024 POOL_DOCS=8 HOST_DOCS=2 DISK=/tmp/kvdisk python notebooks/gpu_kv_disk.py
"""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np

from atlasjax import LLM, SamplingParams, compile_cache

MODEL = os.environ.get("MODEL", ".cache/llama8b")
DOCS = int(os.environ.get("DOCS", 32))
DOC_LEN = int(os.environ.get("DOC_LEN", 1024))
POOL_DOCS = int(os.environ.get("POOL_DOCS", 8))
HOST_DOCS = int(os.environ.get("HOST_DOCS", 2))
DISK = os.environ.get("DISK", "/tmp/kvdisk")
PAGE = 16
PAGE_BYTES = 32 * 2 * 8 * PAGE * 128 * 2                   # 8B: layers, K and V, KV heads, page, dim, bf16
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def engine() -> LLM:
    doc_bytes = (DOC_LEN // PAGE + 1) * PAGE_BYTES
    llm = LLM(MODEL, load_format="dummy", max_num_seqs=8, max_model_len=DOC_LEN + 64, max_num_batched_tokens=2048,
              num_pages=POOL_DOCS * (DOC_LEN // PAGE + 4), kv_offloading_size=round(HOST_DOCS * doc_bytes / 2**30, 3),
              kv_offloading_disk=DISK, kv_offloading_disk_size=round(2 * DOCS * doc_bytes / 2**30, 2))
    llm.engine.kv_offload.warmup(llm.engine.runner)        # what serve's start compiles
    rng = np.random.default_rng(1)
    warm = [rng.integers(0, 128000, DOC_LEN).tolist() for _ in range(2)]
    timed(llm, warm + [warm[0] + rng.integers(0, 128000, 8).tolist()], ONE)   # compiles both step shapes
    return llm


def timed(llm, prompts, one) -> tuple[list[float], list[int]]:
    seconds, cached = [], []
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate({"prompt_token_ids": p}, one)[0]
        seconds.append(time.perf_counter() - t)
        cached.append(out.num_cached_tokens)
    return seconds, cached


def report(phase: str, llm, seconds, cached, **extra) -> None:
    stats = llm.engine.stats
    print(json.dumps({"phase": phase, "docs": DOCS, "doc_len": DOC_LEN, "total_s": round(sum(seconds), 3),
                      "median_ms": round(1e3 * float(np.median(seconds)), 1),
                      "p90_ms": round(1e3 * float(np.percentile(seconds, 90)), 1),
                      "max_ms": round(1e3 * max(seconds), 1), "cached_tokens_median": int(np.median(cached)),
                      "offload_hits": stats.kv_offload_hits, "disk_reads": stats.kv_offload_disk_reads,
                      "disk_pages": stats.kv_offload_disk_pages, **extra}), flush=True)


def drop_page_cache(directory: str) -> int:
    n = 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except FileNotFoundError:     # a write's temporary file, renamed meanwhile
                continue
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            n += 1
    return n


def main() -> None:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("atlasjax.compile").setLevel(logging.WARNING)
    compile_cache.enable("/tmp/atlasjax-jax-cache")        # the later engines reuse the first one's programs
    shutil.rmtree(DISK, ignore_errors=True)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 128000, DOC_LEN).tolist() for _ in range(DOCS)]
    again = [d + rng.integers(0, 128000, 8).tolist() for d in docs]
    one = ONE

    llm = engine()
    fresh = [rng.integers(0, 128000, DOC_LEN + 8).tolist() for _ in range(8)]
    seconds, cached = timed(llm, fresh, one)
    report("computed: prompts of the re-reads' length, nothing cached", llm, seconds, cached)
    llm.reset_prefix_cache()                                  # (empties the files too)
    seconds, cached = timed(llm, docs, one)
    t = time.perf_counter()
    llm.engine.kv_offload.disk.flush()
    report("first read (computed; pages saved and written)", llm, seconds, cached,
           flush_wait_s=round(time.perf_counter() - t, 3))
    seconds, cached = timed(llm, again, one)
    report("same engine, again (host memory, then files)", llm, seconds, cached)
    llm.engine.kv_offload.disk.flush()
    del llm

    for phase in ("restart, files in the page cache", "restart, files dropped from the page cache"):
        extra = {}
        if "dropped" in phase:
            t = time.perf_counter()
            extra = {"files_dropped": drop_page_cache(DISK), "drop_s": round(time.perf_counter() - t, 2)}
        t = time.perf_counter()
        llm = engine()
        extra["engine_start_s"] = round(time.perf_counter() - t, 1)
        seconds, cached = timed(llm, again, one)
        report(phase, llm, seconds, cached, **extra)
        llm.engine.kv_offload.disk.flush()
        del llm


if __name__ == "__main__":
    main()

"""GPU: what a cold disk read costs the requests already running (`kv_offloading_disk`), with the engine thread
waiting for the reads as the request is scheduled (`blocking`, session 73's design, forced here; session 74's
figures ran an earlier form of it, the files read by `HostKVCache.claim` itself) and with the reads in the
background while the request waits in the queue (`background`, the default since session 74).

Llama-3.1-8B shapes (random bf16 weights over MODEL's config.json). DOCS documents of DOC_LEN random tokens are
read once, so their pages land in files under DISK (the device pool and host memory keep only the last few). Then,
per mode: the files are dropped from the OS page cache, STREAMS requests decode long answers, and every GAP steps
one of READS documents (+ 8 tokens) is asked again: its prefix comes from the disk. Reports per mode, as JSON
lines: the streams' gaps between tokens (median, p99, max) while the reads ran, and each re-read's time to its
first token with its cached tokens.

    MODEL=.cache/llama8b DISK=/tmp/kvdisk python notebooks/gpu_kv_disk_background.py
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

import numpy as np

from atlasjax import LLM, SamplingParams, compile_cache
from atlasjax.kv_offload import HostKVCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kv_disk import drop_page_cache  # noqa: E402  (the notebook beside this one)

MODEL = os.environ.get("MODEL", ".cache/llama8b")
DOCS = int(os.environ.get("DOCS", 32))
DOC_LEN = int(os.environ.get("DOC_LEN", 1024))
READS = int(os.environ.get("READS", 6))
STREAMS = int(os.environ.get("STREAMS", 4))
GAP = int(os.environ.get("GAP", 12))
DISK = os.environ.get("DISK", "/tmp/kvdisk")
PAGE = 16


def page_bytes(model: str) -> int:
    """One page's K and V over every layer, in bf16 (an 8B: 2 MiB)."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * PAGE * head_dim * 2


STREAM_TOKENS = GAP * (READS + 2) * 4                      # the streams outlast the reads
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def run(llm, mode: str, docs: list[list[int]], rng) -> None:
    engine = llm.engine
    engine.kv_offload.disk.flush()
    drop_page_cache(DISK)
    stream = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    for i in range(STREAMS):
        engine.add_request(f"s{i}", rng.integers(0, 128000, 32).tolist(), stream)
    added, first, stamps, steps = {}, {}, {f"s{i}": [] for i in range(STREAMS)}, 0
    pending = [d + rng.integers(0, 128000, 8).tolist() for d in docs]
    while engine.has_unfinished():
        if steps >= 2 * GAP and steps % GAP == 0 and pending:
            rid = f"d{len(added)}"
            engine.add_request(rid, pending.pop(0), ONE)
            added[rid] = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        steps += 1
        for d in deltas:
            if d.request_id in stamps and d.new_token_ids:
                stamps[d.request_id].append(now)
            elif d.request_id in added and d.request_id not in first:
                first[d.request_id] = (now - added[d.request_id], d.num_cached_tokens)
        if not pending and len(first) == len(added):
            break
    window = (min(added.values()), max(added[r] + first[r][0] for r in first))
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:]) if window[0] <= b <= window[1]]
    for rid in list(stamps):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    for rid in list(engine.requests):
        engine.release(rid)
    ttft = [first[r][0] for r in sorted(first)]
    print(json.dumps({
        "mode": mode, "streams": STREAMS, "reads": len(first), "doc_len": DOC_LEN,
        "stream_gap_ms": {"median": round(1e3 * float(np.median(gaps)), 2),
                          "p99": round(1e3 * float(np.percentile(gaps, 99)), 2), "max": round(1e3 * max(gaps), 2)},
        "read_ttft_ms": [round(1e3 * t, 1) for t in ttft],
        "read_ttft_median_ms": round(1e3 * float(np.median(ttft)), 1),
        "cached_tokens": [first[r][1] for r in sorted(first)], "disk_reads": engine.stats.kv_offload_disk_reads}),
        flush=True)


def main() -> None:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("atlasjax.compile").setLevel(logging.WARNING)
    compile_cache.enable("/tmp/atlasjax-jax-cache")
    shutil.rmtree(DISK, ignore_errors=True)
    doc_bytes = (DOC_LEN // PAGE + 1) * page_bytes(MODEL)
    llm = LLM(MODEL, load_format="dummy", max_num_seqs=8, max_model_len=max(DOC_LEN, STREAM_TOKENS) + 64,
              max_num_batched_tokens=2048, page_size=PAGE,
              num_pages=8 * (DOC_LEN // PAGE + 4) + STREAMS * (STREAM_TOKENS // PAGE + 4),
              kv_offloading_size=2 * doc_bytes / 2**30,
              kv_offloading_disk=DISK, kv_offloading_disk_size=2 * DOCS * doc_bytes / 2**30)
    llm.engine.kv_offload.warmup(llm.engine.runner)        # what serve's start compiles
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 128000, DOC_LEN).tolist() for _ in range(DOCS)]
    llm.generate([{"prompt_token_ids": d} for d in docs[-2:]] + [{"prompt_token_ids": docs[-1] + [1] * 8}], ONE)
    for d in docs:                                          # pages to host memory and, written through, to files
        llm.generate({"prompt_token_ids": d}, ONE)
    llm.engine.kv_offload.disk.flush()
    run(llm, "warm-up (compiles the step shapes; files cold)", docs[2 * READS:3 * READS], rng)
    background = HostKVCache.fetching

    def blocking(self, keys, limit):     # the engine thread waits for the files as the request is scheduled
        while background(self, keys, limit):
            self.wait_for_reads(1.0)
        return False

    HostKVCache.fetching = blocking
    run(llm, "blocking", docs[:READS], rng)
    HostKVCache.fetching = background
    run(llm, "background", docs[READS:2 * READS], rng)


if __name__ == "__main__":
    main()

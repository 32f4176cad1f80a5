"""Does a restarted server reuse its compiled steps? Starts the same server several times on one
compilation cache and records, for each start, how long it took to be ready, what the persistent
cache answered, the KV pool it sized and what the cache directory holds afterwards.

GPU: `PRESET=llama-3.1-8b QUANT=int4 STARTS=2 python notebooks/serve_restart.py [more server flags]`
STORE_OFF_STARTS=2 (a comma list of start indexes) runs those starts with the program store switched off
(ATLASJAX_PROGRAM_STORE=off): they lower every program and load only from jax's cache.
CPU check: `PRESET=tiny STARTS=2 python notebooks/serve_restart.py`
Writes $OUT/serve_restart.json and each start's log when $OUT is set. The last start also answers a
short load (`bench serve`, 16 prompts), so executables loaded from the cache are shown to run.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

PRESET, QUANT = os.environ.get("PRESET", "tiny"), os.environ.get("QUANT")
STARTS, PORT = int(os.environ.get("STARTS", "2")), os.environ.get("PORT", "8000")
TAG = os.environ.get("TAG", "")   # prefix of the result and log files
STORE_OFF = {int(i) for i in os.environ.get("STORE_OFF_STARTS", "").split(",") if i.strip()}


def cache_files(path: str) -> tuple[int, int]:
    sizes = [e.stat().st_size for e in os.scandir(path) if e.is_file()] if os.path.isdir(path) else []
    return len(sizes), sum(sizes)


def start(i: int, cache: str, work: str) -> dict:
    log_path = os.path.join(os.environ.get("OUT") or work, f"{TAG}server{i}.log")
    # the cache's hit / miss lines (add jax._src.cache_key for the hash of each part of a key)
    env = dict(os.environ, JAX_DEBUG_LOG_MODULES=os.environ.get("JAX_DEBUG_LOG_MODULES", "jax._src.compiler"))
    if i in STORE_OFF:
        env["ATLASJAX_PROGRAM_STORE"] = "off"
    cmd = [sys.executable, "-m", "atlasjax.bench.preset_server", "--preset", PRESET, "--port", PORT, "-v",
           "--max-num-seqs", "64", "--compilation-cache", cache, *(["--quantization", QUANT] if QUANT else []),
           *sys.argv[1:]]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while "ready on" not in (text := open(log_path).read()):
            if server.poll() is not None:
                raise SystemExit(f"start {i}: the server exited:\n{text[-3000:]}")
            time.sleep(0.5)
        ready_s = time.perf_counter() - t0
        served = None
        if i == STARTS - 1:
            bench = [sys.executable, "-m", "atlasjax.bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}",
                     "--preset", PRESET, "--input-len", "128", "--output-len", "32", "--no-warmup-buckets",
                     "--num-warmups", "2", "--max-concurrency", "4", "--num-prompts", "16"]
            served = subprocess.run(bench, capture_output=True, text=True).returncode == 0
    finally:
        server.terminate()
        server.wait(60)
    text = open(log_path).read()
    files, size = cache_files(cache)
    pool = re.search(r"KV pool: .*", text)
    warmup = re.search(r"warmup (\{.*\})", text)
    programs, programs_size = cache_files(os.path.join(cache, "programs"))
    return dict(start=i, program_store=i not in STORE_OFF, ready_s=round(ready_s, 1), served_ok=served,
                warmup=json.loads(warmup.group(1)) if warmup else None,
                step_loads=len(re.findall(r"load \{", text)), programs=programs,
                programs_mb=round(programs_size / 2**20, 1),
                cache_hits=text.count("Persistent compilation cache hit"),
                cache_misses=text.count("PERSISTENT COMPILATION CACHE MISS"),
                step_compiles=len(re.findall(r"compile \{", text)), kv_pool=pool.group(0) if pool else None,
                cache_files=files, cache_mb=round(size / 2**20, 1))


def main() -> None:
    work = tempfile.mkdtemp()
    cache = os.path.join(work, "xla-cache")
    runs = []
    for i in range(STARTS):
        runs.append(start(i, cache, work))
        print(json.dumps(runs[-1]), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{TAG}serve_restart.json"), "w") as f:
            json.dump(dict(preset=PRESET, quantization=QUANT, server_flags=sys.argv[1:], starts=runs), f, indent=1)


if __name__ == "__main__":
    main()

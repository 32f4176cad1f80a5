"""Does the engine's own process (`serve --engine-process`) serve faster than the engine thread? Starts the
same preset server in turn without and with the flag (on one compilation cache, so only the first start
compiles) and runs `bench serve` against each at every concurrency.

GPU: `PRESET=llama-3.1-8b QUANT=int4 ORDER=thread,process,thread C=1,16,64 python notebooks/serve_engine_process.py`
CPU check: `PRESET=tiny ORDER=thread,process C=1,4 OUTPUT_LEN=8 python notebooks/serve_engine_process.py`
INPUT_LEN=8,128 benches each concurrency at both prompt lengths (how much the prefills of arriving requests
cost the decoding ones).
Extra arguments go to the server. Writes $OUT/engine_process.json and each start's log when $OUT is set.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

PRESET, QUANT = os.environ.get("PRESET", "tiny"), os.environ.get("QUANT")
ORDER = os.environ.get("ORDER", "thread,process").split(",")
CONCURRENCY = [int(c) for c in os.environ.get("C", "1,16,64").split(",")]
OUTPUT_LEN, PORT = os.environ.get("OUTPUT_LEN", "128"), os.environ.get("PORT", "8000")
INPUT_LENS = os.environ.get("INPUT_LEN", "128").split(",")   # several: one bench per length and concurrency
ROUNDS = int(os.environ.get("ROUNDS", "4"))   # prompts per concurrency: ROUNDS x C (at least 16)


def run_start(i: int, mode: str, cache: str, out: str) -> dict:
    log_path = os.path.join(out, f"server{i}_{mode}.log")
    cmd = [sys.executable, "-m", "atlasjax.bench.preset_server", "--preset", PRESET, "--port", PORT,
           "--max-num-seqs", "64", "--compilation-cache", cache, *(["--quantization", QUANT] if QUANT else []),
           *(["--engine-process"] if mode == "process" else []), *sys.argv[1:]]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    result = dict(mode=mode)
    try:
        while "ready on" not in (text := open(log_path).read()):
            if server.poll() is not None:
                raise SystemExit(f"start {i} ({mode}): the server exited:\n{text[-3000:]}")
            time.sleep(0.5)
        result["ready_s"] = round(time.perf_counter() - t0, 1)
        for c in CONCURRENCY:
            for input_len in INPUT_LENS:
                key = f"c{c}" if INPUT_LENS == ["128"] else f"c{c}_in{input_len}"
                path = os.path.join(out, f"bench{i}_{mode}_{key}.json")
                bench = [sys.executable, "-m", "atlasjax.bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}",
                         "--preset", PRESET, "--input-len", input_len, "--output-len", OUTPUT_LEN,
                         "--no-warmup-buckets", "--num-warmups", "4", "--max-concurrency", str(c),
                         "--num-prompts", str(max(16, ROUNDS * c)), "--output", path]
                done = subprocess.run(bench, capture_output=True, text=True)
                if done.returncode != 0:
                    result[key] = dict(error=done.stderr[-2000:])
                    continue
                m = json.load(open(path))["results"]
                result[key] = dict(tpot_mean_ms=round(m["tpot_s"]["mean"] * 1e3, 3),
                                   ttft_mean_ms=round(m["ttft_s"]["mean"] * 1e3, 1),
                                   output_tok_s=round(m["output_throughput"], 1))
                print(i, mode, key, result[key], flush=True)
    finally:
        server.terminate()
        server.wait(120)
    result["stopped_cleanly"] = server.returncode == 0
    return result


def main() -> None:
    out = os.environ.get("OUT") or tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    cache = os.environ.get("CACHE") or tempfile.mkdtemp(prefix="atlasjax-cache-")
    results = [run_start(i, mode, cache, out) for i, mode in enumerate(ORDER)]
    with open(os.path.join(out, "engine_process.json"), "w") as f:
        json.dump(dict(preset=PRESET, quantization=QUANT, concurrency=CONCURRENCY, output_len=OUTPUT_LEN,
                       starts=results), f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

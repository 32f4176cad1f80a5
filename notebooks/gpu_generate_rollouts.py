"""GPU: RL-style rollouts through a live server's SGLang `/generate` against the same load through `/v1/completions`
(`return_token_ids`), then `/abort_request` cutting a wave off, and a long `/generate` stream against the same
answer whole (a stream resends the text and ids so far at every step, as SGLang's default streaming does).

Llama-3.1-8B shapes with random bf16 weights (`--load-format dummy` over MODEL's config.json and its tokenizer),
PROMPTS prompts of IN random token ids, N samples each, OUT_LEN tokens (ignore_eos, temperature 1, seeded), the
chosen tokens' logprobs asked on both routes. JSON lines on stdout; the server's log in $OUT/server.log.

    MODEL=.cache/llama8b PROMPTS=32 N=8 IN=128 OUT_LEN=256 python notebooks/gpu_generate_rollouts.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

MODEL = os.environ.get("MODEL", ".cache/llama8b")
PROMPTS, N = int(os.environ.get("PROMPTS", 32)), int(os.environ.get("N", 8))
IN, OUT_LEN = int(os.environ.get("IN", 128)), int(os.environ.get("OUT_LEN", 256))
LONG = int(os.environ.get("LONG", 2048))     # the aborted wave's and the stream's max_new_tokens
OUT = os.environ.get("OUT", "/tmp/out")
SEQS = PROMPTS * N


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def start_server() -> tuple[subprocess.Popen, str]:
    log = open(os.path.join(OUT, "server.log"), "w")
    cmd = [sys.executable, "-m", "atlasjax", "serve", "--model", MODEL, "--load-format", "dummy", "--port", "0",
           "--max-num-seqs", str(SEQS), "--max-model-len", str(IN + LONG + 64), "--max-num-batched-tokens", "8192",
           "--compilation-cache", "/tmp/atlasjax_cc"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    start = time.time()
    while time.time() - start < 900:
        for line in open(os.path.join(OUT, "server.log")):
            if line.startswith("atlasjax: ready on "):
                report(event="ready", seconds=round(time.time() - start, 1))
                return proc, line.split("ready on ", 1)[1].strip()
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {open(os.path.join(OUT, 'server.log')).read()[-3000:]}")
        time.sleep(1)
    raise SystemExit("the server was not ready in 900 s")


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    proc, url = start_server()
    http = httpx.Client(base_url=url, timeout=1800)
    prompts = np.random.default_rng(0).integers(0, 128000, (PROMPTS, IN)).tolist()
    generate = dict(input_ids=prompts, return_logprob=True, sampling_params={
        "max_new_tokens": OUT_LEN, "n": N, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0})
    completions = dict(prompt=prompts, n=N, max_tokens=OUT_LEN, temperature=1.0, ignore_eos=True, seed=0, logprobs=0,
                       return_token_ids=True)
    try:
        http.post("/generate", json={**generate, "input_ids": prompts[:1]})      # warm the sampling paths
        for wave in range(2):
            for route, body in (("/generate", generate), ("/v1/completions", completions)):
                r, seconds = timed(lambda: http.post(route, json=body))
                r.raise_for_status()
                answers = r.json() if route == "/generate" else r.json()["choices"]
                ids = [a["output_ids"] if route == "/generate" else a["token_ids"] for a in answers]
                report(route=route, wave=wave, sequences=len(ids), tokens=sum(map(len, ids)),
                       seconds=round(seconds, 2), output_tok_s=round(sum(map(len, ids)) / seconds))
        # a wave cut off by /abort_request after 2 s: how soon it answers, and the pages all back
        result = {}
        long_wave = {**generate, "sampling_params": {**generate["sampling_params"], "max_new_tokens": LONG}}
        thread = threading.Thread(target=lambda: result.update(r=timed(lambda: http.post("/generate", json=long_wave))))
        thread.start()
        time.sleep(2.0)
        abort_at = time.perf_counter()
        http.post("/abort_request", json={"abort_all": True})
        thread.join()
        r, seconds = result["r"]
        outs = r.json()
        health = http.get("/health").json()
        report(event="abort_all", answered_after_abort_s=round(time.perf_counter() - abort_at, 3),
               finish=sorted({o["meta_info"]["finish_reason"]["type"] for o in outs}),
               tokens_each=[min(len(o["output_ids"]) for o in outs), max(len(o["output_ids"]) for o in outs)],
               pages_free=health["kv_pages_free"], pages_total=health["kv_pages_total"])
        # one long stream against the same answer whole (greedy)
        body = dict(input_ids=prompts[0], sampling_params={"max_new_tokens": LONG, "temperature": 0,
                                                           "ignore_eos": True})
        whole, whole_s = timed(lambda: http.post("/generate", json=body).json())
        events, start = 0, time.perf_counter()
        with http.stream("POST", "/generate", json={**body, "stream": True}) as s:
            last, size = None, 0
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    events, size, last = events + 1, size + len(line), line
        stream_s = time.perf_counter() - start
        last = json.loads(last[len("data: "):])
        report(event="stream", tokens=LONG, whole_s=round(whole_s, 2), stream_s=round(stream_s, 2), events=events,
               megabytes_sent=round(size / 1e6, 1), same_ids=last["output_ids"] == whole["output_ids"])
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()

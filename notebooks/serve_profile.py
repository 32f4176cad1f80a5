"""Where a served step's host time goes: the engine thread against the HTTP event loop.

Starts `python -m atlasjax.bench.preset_server`, loads it with `python -m atlasjax.bench serve`, and
while the load runs records
- each thread's CPU time over the window, from /proc (Linux);
- two py-spy recordings (py-spy must be on PATH): `--gil` (which thread holds the GIL) and `--idle`
  (where each thread's wall time goes, waiting included), summarized per thread and, for the engine
  thread, by inclusive frame.
Session 42 ran these steps by hand (docs/performance.md); this script is the same procedure.

GPU: `PRESET=llama-3.1-8b QUANT=int4 C=16 python notebooks/serve_profile.py [more server flags]`
CPU check: `PRESET=tiny C=4 PROMPTS=64 python notebooks/serve_profile.py`
Writes $OUT/serve_profile.json when $OUT is set.
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

PRESET, QUANT = os.environ.get("PRESET", "tiny"), os.environ.get("QUANT")
C, PROMPTS = int(os.environ.get("C", "16")), int(os.environ.get("PROMPTS", "640"))
SECONDS, PORT = float(os.environ.get("SECONDS", "6")), os.environ.get("PORT", "8000")
RATE = 200   # py-spy samples per second


def thread_cpu_ms(pid: int) -> dict[int, float]:
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) * tick_ms   # utime + stime
    return out


def spy(pid: int, mode: str, path: str) -> None:
    subprocess.run(["py-spy", "record", "-p", str(pid), "--threads", mode, "--nonblocking", "-r", str(RATE),
                    "-d", str(int(SECONDS)), "--format", "raw", "-o", path], check=True, capture_output=True)


def summarize(path: str, instants: float) -> dict:
    """Samples per thread (as a share of the sampling instants) and the engine thread's inclusive frames."""
    threads, frames = collections.Counter(), collections.Counter()
    names = {}
    for line in open(path):
        stack, n = line.rstrip().rsplit(" ", 1)
        parts = stack.split(";")
        m = re.match(r"thread \((\d+)\)(?:: (.*))?", parts[0])
        tid = int(m.group(1))
        names[tid] = m.group(2) or names.get(tid, "")
        threads[tid] += int(n)
        if names[tid] == "atlasjax-engine":
            for f in {re.sub(r" \((.*?):\d+\)", r" (\1)", f) for f in parts[1:]}:
                frames[f] += int(n)
    engine_total = sum(n for t, n in threads.items() if names[t] == "atlasjax-engine") or 1
    return dict(names=names, share={t: round(n / instants, 3) for t, n in threads.most_common(6)},
                engine_frames={f: round(n / engine_total, 3) for f, n in frames.most_common(25)})


def main() -> None:
    work = tempfile.mkdtemp()
    log = open(os.path.join(work, "server.log"), "w")
    cmd = [sys.executable, "-m", "atlasjax.bench.preset_server", "--preset", PRESET, "--port", PORT,
           "--max-num-seqs", "64", *(["--quantization", QUANT] if QUANT else []), *sys.argv[1:]]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while "ready on" not in open(log.name).read():
            if server.poll() is not None:
                raise SystemExit(f"the server exited:\n{open(log.name).read()[-3000:]}")
            time.sleep(1)
        bench = [sys.executable, "-m", "atlasjax.bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}",
                 "--preset", PRESET, "--input-len", "128", "--output-len", "128", "--no-warmup-buckets",
                 "--num-warmups", "4", "--max-concurrency", str(C)]
        subprocess.run([*bench, "--num-prompts", str(2 * C)], check=True, capture_output=True)   # warm
        report = os.path.join(work, "bench.json")
        load = subprocess.Popen([*bench, "--num-prompts", str(PROMPTS), "--output", report],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)
        t0, cpu0 = time.perf_counter(), thread_cpu_ms(server.pid)
        gil, idle = os.path.join(work, "gil.txt"), os.path.join(work, "idle.txt")
        spy(server.pid, "--gil", gil)
        spy(server.pid, "--idle", idle)
        wall_ms, cpu1 = (time.perf_counter() - t0) * 1e3, thread_cpu_ms(server.pid)
        busy = load.poll() is None          # the load outlasted the recordings (else raise PROMPTS)
        load.wait()
        results = json.load(open(report))["results"]
        out = dict(preset=PRESET, quantization=QUANT, concurrency=C, server_flags=sys.argv[1:],
                   load_outlasted_recordings=busy, tpot_s=results.get("tpot_s", {}),
                   gil=summarize(gil, RATE * SECONDS), idle=summarize(idle, RATE * SECONDS))
        names = {**out["idle"]["names"], **out["gil"]["names"]}
        out["cpu_share"] = {f"{tid} {names.get(tid, '')}".strip(): round((cpu1[tid] - cpu0.get(tid, 0)) / wall_ms, 3)
                            for tid in cpu1 if cpu1[tid] - cpu0.get(tid, 0) > 0.01 * wall_ms}
        text = json.dumps(out, indent=1, default=str)
        print(text)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "serve_profile.json"), "w") as f:
                f.write(text)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()

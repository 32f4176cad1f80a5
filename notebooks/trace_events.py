"""The GPU kernels of a `jax.profiler` trace and a coarse category per kernel name (for the profile notebooks)."""
import glob
import gzip
import json
import re


def load(trace_dir: str) -> tuple[list[dict], list[dict], dict]:
    """(GPU kernel events sorted by start, all events, pid -> process name) of the newest trace under trace_dir."""
    files = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(sorted(files)[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = [e for e in events if e.get("ph") == "X" and "dur" in e
           and ("gpu" in names.get(e["pid"], "").lower() or "/device" in names.get(e["pid"], "").lower())]
    gpu.sort(key=lambda e: e["ts"])
    return gpu, events, names


def category(name: str) -> str:
    n = name.lower()
    for cat, pat in (("gemm", r"gemm|gemv|cublas|cutlass|xmma|matmul|dot|sm90"), ("attention", r"attention|paged"),
                     ("quantized_matmul", r"quant|dequant"), ("memcpy", r"memcpy|memset"),
                     ("reduce_fusion", r"reduce"), ("scatter", r"scatter|dynamic.update"), ("fusion", r"fusion")):
        if re.search(pat, n):
            return cat
    return "other"


def timeline(gpu: list[dict]) -> dict:
    """Over kernels sorted by start: busy (us in the union of their intervals), span (first start to last end),
    gap_before (per kernel: us since the kernels before it ended; negative where it overlaps them), overlaps and
    overlap_us (kernels that start before the earlier ones end, as programmatic dependent launch allows)."""
    busy, end, gap_before, overlaps, overlap_us = 0.0, None, [], 0, 0.0
    for e in gpu:
        s, t = e["ts"], e["ts"] + e["dur"]
        gap_before.append(0.0 if end is None else s - end)
        if end is not None and s < end:
            overlaps += 1
            overlap_us += min(end, t) - s
        if end is None or s >= end:
            busy += e["dur"]
            end = t
        elif t > end:
            busy += t - end
            end = t
    return dict(busy=busy, span=end - gpu[0]["ts"], gap_before=gap_before, overlaps=overlaps, overlap_us=overlap_us)

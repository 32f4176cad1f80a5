"""Reports: summary statistics, the environment block, the readable table and the JSON file.

Every mode returns one dict: {"mode", "settings", "results", "roofline", ...}. `finish` adds the
environment (device, versions, git commit, command line), prints the table to stdout and writes
the JSON when `--output` is given. Progress goes to stderr, so stdout holds only the report.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def summarize(values, percentiles=(10, 50, 90, 99)) -> dict:
    """mean, median, min, max and percentiles (linear interpolation) of a list; None when empty."""
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return dict(n=0, mean=None, median=None, **{f"p{p}": None for p in percentiles})
    arr = np.asarray(vals, np.float64)
    out = dict(n=len(vals), mean=float(arr.mean()), median=float(np.median(arr)), min=float(arr.min()),
               max=float(arr.max()), std=float(arr.std()))
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in percentiles})
    return out


def git_commit() -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "HEAD") or None
    return dict(commit=commit, dirty=bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None)


def environment(argv: list[str], with_device: bool = True) -> dict:
    """Where and how the numbers were taken. with_device=False leaves the JAX backend uninitialized."""
    from importlib import metadata  # noqa: PLC0415

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None
    env = dict(timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               hostname=platform.node(), python=platform.python_version(),
               jax=version("jax"), jaxlib=version("jaxlib"), flax=version("flax"),
               command=shlex.join([os.path.basename(sys.executable), "-m", "atlasjax.bench", *argv]),
               xla_flags=os.environ.get("XLA_FLAGS", ""),   # as the backend read them (atlasjax may add one)
               **{f"git_{k}": v for k, v in git_commit().items()})
    if with_device:
        import jax  # noqa: PLC0415
        dev = jax.devices()[0]
        env.update(device=dev.device_kind, platform=dev.platform, num_devices=jax.device_count())
    return env


# ---- formatting
def fmt(value, unit: str = "", scale: float = 1.0) -> str:
    """A number at readable precision (3-4 significant digits, thousands separated)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    v = value * scale
    text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}" if abs(v) >= 1 \
        else f"{v:.3g}"
    return text + unit


def si(value, unit: str) -> str:
    """value with an SI prefix: si(1.5e10, "B") -> '15.0 GB'."""
    if value is None:
        return "-"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return fmt(value / scale, f" {prefix}{unit}")
    return fmt(value, f" {unit}")


def table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    out = [f"== {title} ==", "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in
                                       enumerate(zip(headers, widths))), line]
    for r in rows:
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def stats_rows(named: list[tuple[str, dict, str, float]], cols=("mean", "median", "p10", "p90", "p99")) -> list:
    """[name, summary, unit, scale] -> table rows of the chosen statistics."""
    return [[name, *(fmt(s.get(c), "", scale) for c in cols), unit] for name, s, unit, scale in named]


def roofline_rows(roof: dict) -> list[list[str]]:
    rows = []
    ceil = roof.get("ceilings")
    if ceil:
        rows.append(["device copy bandwidth (measured)", si(ceil["copy_bandwidth_Bps"], "B/s"), ceil.get("copy_method", "")])
        rows.append([f"{ceil['matmul_dtype']} matmul {ceil['matmul_n']}^3 (measured)",
                     si(ceil["matmul_flops_per_s"], "FLOP/s"), ""])
    if roof.get("note"):
        rows.append(["note", roof["note"], ""])
    if roof.get("roofline_output_tokens_per_s"):
        rows.append(["roofline output tok/s at this concurrency", fmt(roof["roofline_output_tokens_per_s"]),
                     f"measured is {fmt(roof['frac_roofline_output_throughput'], '%', 100)} of it"])
    for name, a in roof.items():
        if name == "ceilings" or not isinstance(a, dict) or "bytes" not in a:
            continue
        rows.append([f"{name}: bytes that must move", si(a["bytes"], "B"),
                     f"weights {si(a['weight_bytes'], 'B')} + KV {si(a['kv_bytes'], 'B')}"])
        rows.append([f"{name}: FLOPs", si(a["flops"], "FLOP"), ""])
        if "bytes_per_s" in a:
            of = f" x {a['devices']} devices" if a.get("devices", 1) > 1 else ""
            rows.append([f"{name}: achieved bandwidth", si(a["bytes_per_s"], "B/s"),
                         f"{fmt(a.get('frac_copy_bandwidth'), '%', 100)} of copy{of}"])
            rows.append([f"{name}: achieved FLOP rate", si(a["flops_per_s"], "FLOP/s"),
                         f"{fmt(a.get('frac_matmul_rate'), '%', 100)} of matmul{of}"])
        if "floor_seconds" in a:
            rows.append([f"{name}: roofline floor ({a['bound']}-bound)", fmt(a["floor_seconds"], " ms", 1e3),
                         f"measured time is {fmt(a['frac_roofline'], '%', 100)} of roofline speed"])
    return rows


def finish(report: dict, argv: list[str], output: str | None, tables: list[str], with_device: bool = True) -> dict:
    report = dict(report, environment=environment(argv, with_device))
    env = report["environment"]
    head = (f"atlasjax.bench {report['mode']} | {env.get('device', 'no local device')} | jax {env['jax']} "
            f"flax {env['flax']} | git {str(env['git_commit'])[:10]}{'+dirty' if env['git_dirty'] else ''}")
    print(head)
    for t in tables:
        print()
        print(t)
    sys.stdout.flush()
    if output:
        with open(output, "w") as f:
            json.dump(report, f, indent=1, default=_json_default)
        print(f"[bench] wrote {output}", file=sys.stderr)
    return report


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)

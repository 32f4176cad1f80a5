"""The persistent compilation cache of `python -m atlasjax`: where it lives, and a second run
loading the first run's executables instead of compiling them."""
from __future__ import annotations

import os
import subprocess
import sys

from atlasjax import compile_cache


def test_the_cache_is_opt_in(monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    assert compile_cache.resolve(None) is None
    assert compile_cache.resolve("~/c") == os.path.expanduser("~/c")
    assert compile_cache.resolve("off") is None
    monkeypatch.setenv(compile_cache.ENV, "/from/env")
    assert compile_cache.resolve(None) == "/from/env"
    assert compile_cache.resolve("/flag") == "/flag"         # the flag wins
    assert compile_cache.resolve("OFF") is None
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve(None) is None


def _files(d) -> set[str]:
    return {os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs}


def _run_twice(cmd, cache):
    """Run `cmd` with the cache twice; assert the first wrote entries and the second none (all hits)."""
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}   # cache even quick CPU compiles
    runs, written = [], []
    for _ in range(2):
        runs.append(subprocess.run([*cmd, "--compilation-cache", str(cache)], capture_output=True, text=True,
                                   env=env, timeout=600))
        assert runs[-1].returncode == 0, runs[-1].stderr
        written.append(_files(cache))
    assert written[0], "the first run wrote no executables"
    assert written[1] == written[0]        # every compile of the second run was a cache hit
    return runs


def test_a_second_run_loads_what_the_first_compiled(default_model_path, tmp_path):
    first, second = _run_twice([sys.executable, "-m", "atlasjax", "generate", "The capital of France is",
                                "--max-tokens", "6", "--model", default_model_path, "--max-num-seqs", "1"],
                               tmp_path / "cache")
    assert second.stdout == first.stdout and "Paris" in second.stdout


def test_a_second_bench_run_loads_what_the_first_compiled(tmp_path):
    _run_twice([sys.executable, "-m", "atlasjax.bench", "latency", "--preset", "tiny", "--batch-size", "2",
                "--input-len", "8", "--output-len", "4", "--num-iters", "1"], tmp_path / "cache")

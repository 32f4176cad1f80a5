"""The persistent compilation cache of `python -m atlasjax`: where it lives (on a GPU by default, elsewhere
when asked for), and a second run loading the first run's executables instead of compiling them."""
from __future__ import annotations

import os
import subprocess
import sys

from atlasjax import compile_cache


def test_a_flag_or_the_environment_names_the_cache(monkeypatch):
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


def test_the_command_line_caches_by_default_on_a_gpu_only(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert compile_cache.gpu_expected()
    assert compile_cache.resolve(None, default_on_gpu=True) == str(tmp_path / "atlasjax" / "xla")
    assert compile_cache.resolve(None) is None                        # the bench keeps it opt-in
    assert compile_cache.resolve("off", default_on_gpu=True) is None  # switched off
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve(None, default_on_gpu=True) is None
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not compile_cache.gpu_expected()
    assert compile_cache.resolve(None, default_on_gpu=True) is None
    monkeypatch.setenv("JAX_PLATFORMS", "")                          # unset: a CUDA plugin decides
    monkeypatch.setattr(compile_cache, "CUDA_PLUGINS", ("no_such_plugin_here",))
    assert not compile_cache.gpu_expected()
    monkeypatch.setattr(compile_cache, "CUDA_PLUGINS", ("json",))      # any importable module stands in
    assert compile_cache.gpu_expected()


def test_only_the_default_directory_is_capped(monkeypatch, tmp_path):
    import jax
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
    compile_cache.enable(compile_cache.default_dir())
    assert updates == [("jax_compilation_cache_dir", compile_cache.default_dir()),
                       ("jax_compilation_cache_max_size", compile_cache.DEFAULT_MAX_BYTES)]
    updates.clear()
    compile_cache.enable(str(tmp_path / "mine"))
    assert updates == [("jax_compilation_cache_dir", str(tmp_path / "mine"))]
    updates.clear()
    compile_cache.enable(None)
    assert updates == []


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

"""JAX's persistent compilation cache for the command line (`python -m atlasjax ...`).

A restarted server loads its step executables (and XLA's GEMM autotuning results) from disk instead
of compiling them again: an int4 Llama-3.1-8B server compiles 31 step shapes as it starts, about
two minutes on an H100. jax keys each entry on the program, its compile options, the devices and
the jax version, so a changed model shape, flag or upgrade compiles afresh.

On by default on GPU only: an XLA CPU executable is built for the host's instruction set, which a
cache shared between machines would not check. The library (`LLM`, `LLMEngine`) leaves jax's
configuration alone; `enable(path)` opts a notebook in.
"""
from __future__ import annotations

import os

ENV = "ATLASJAX_COMPILATION_CACHE"
_OFF = ("", "0", "off", "none")


def default_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "atlasjax", "jax")


def resolve(flag: str | None, backend: str) -> str | None:
    """The cache directory: `flag` (--compilation-cache), else $ATLASJAX_COMPILATION_CACHE, else
    `default_path()` on GPU; None (no cache) for "off" or, by default, on other backends."""
    value = flag if flag is not None else os.environ.get(ENV)
    if value is None:
        return default_path() if backend == "gpu" else None
    return None if value.strip().lower() in _OFF else os.path.expanduser(value)


def enable(path: str | None) -> None:
    """Use `path` for jax's persistent compilation cache; before the first compile of the process
    (jax decides once, at its first compile, whether a cache is in use)."""
    if path is not None:
        import jax  # noqa: PLC0415
        jax.config.update("jax_compilation_cache_dir", path)

"""JAX's persistent compilation cache for the command line (`python -m atlasjax ...`), opt-in.

With a cache directory a second run loads its step executables (and XLA's GEMM autotuning results)
from disk instead of compiling them. jax keys each entry on the program, its compile options, the
devices and the jax version, so a changed model shape, flag or upgrade compiles afresh.

Off unless asked for. On one H100 (sessions 42-43) compiles that run one at a time hit on the next
run (`bench latency`, `generate`), and since the server's warm-up lowers its programs in one thread
(runner.py) a restarted server loads every step executable too. Entries take disk space (238 MB for
an int4 8B server), and an XLA CPU executable is built for the host's instruction set, which a cache
shared between machines would not check. The library (`LLM`, `LLMEngine`) leaves jax's configuration
alone; `enable(path)` opts a notebook in.
"""
from __future__ import annotations

import os

ENV = "ATLASJAX_COMPILATION_CACHE"
_OFF = ("", "0", "off", "none")


def resolve(flag: str | None) -> str | None:
    """The cache directory: `flag` (--compilation-cache), else $ATLASJAX_COMPILATION_CACHE; None (no
    cache) when neither is given or the value is "off"."""
    value = flag if flag is not None else os.environ.get(ENV)
    if value is None or value.strip().lower() in _OFF:
        return None
    return os.path.expanduser(value)


def enable(path: str | None) -> None:
    """Use `path` for jax's persistent compilation cache; before the first compile of the process
    (jax decides once, at its first compile, whether a cache is in use)."""
    if path is not None:
        import jax  # noqa: PLC0415
        jax.config.update("jax_compilation_cache_dir", path)

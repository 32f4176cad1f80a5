"""JAX's persistent compilation cache for the command line (`python -m atlasjax ...`).

With a cache directory a second run loads its step executables (and XLA's GEMM autotuning results)
from disk instead of compiling them. jax keys each entry on the program, its compile options, the
devices and the jax version, so a changed model shape, flag or upgrade compiles afresh.

On a GPU the commands of `python -m atlasjax` (serve, generate, chat, save) use `default_dir()`,
~/.cache/atlasjax/xla, as vLLM keeps its compile cache, capped at `DEFAULT_MAX_BYTES` (jax evicts the
least recently used entries past it). On one H100 a restarted int4 8B server loaded every step
executable from it and was ready in 56.5 s against 93.6 s for the start that wrote them (238 MB;
session 44, with the kernel lowering memo). Elsewhere, and for `python -m atlasjax.bench` whose
reports time cold compiles, the cache is opt-in: an XLA CPU executable is built for the host's
instruction set, which a cache shared between machines would not check. The directory's `programs/`
folder is the program store (atlasjax/program_store.py): whole step programs keyed without tracing,
which a restart loads without lowering (16.0 s for that int4 8B server, session 45). `--compilation-cache off`
(or $ATLASJAX_COMPILATION_CACHE=off) turns it off; the library (`LLM`, `LLMEngine`) leaves jax's
configuration alone, and `enable(path)` opts a notebook in.
"""
from __future__ import annotations

import importlib.util
import os

ENV = "ATLASJAX_COMPILATION_CACHE"
_OFF = ("", "0", "off", "none")
DEFAULT_MAX_BYTES = 10 * 2**30
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def default_dir() -> str:
    """$XDG_CACHE_HOME/atlasjax/xla, ~/.cache/atlasjax/xla without it."""
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "~/.cache"), "atlasjax", "xla")


def gpu_expected() -> bool:
    """Whether jax will run on a CUDA GPU, told without starting a backend (a multi-host run must call
    jax.distributed.initialize first): $JAX_PLATFORMS names cuda or gpu, or, unset, a CUDA plugin is
    installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return any(p.strip() in ("cuda", "gpu") for p in platforms.split(","))
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def resolve(flag: str | None, *, default_on_gpu: bool = False) -> str | None:
    """The cache directory: `flag` (--compilation-cache), else $ATLASJAX_COMPILATION_CACHE, else
    `default_dir()` when `default_on_gpu` and a GPU is expected; None (no cache) when none applies or
    the value is "off"."""
    value = flag if flag is not None else os.environ.get(ENV)
    if value is None:
        return default_dir() if default_on_gpu and gpu_expected() else None
    if value.strip().lower() in _OFF:
        return None
    return os.path.expanduser(value)


def enable(path: str | None) -> None:
    """Use `path` for jax's persistent compilation cache (the default directory capped at
    DEFAULT_MAX_BYTES); before the first compile of the process (jax decides once, at its first
    compile, whether a cache is in use)."""
    if path is not None:
        import jax  # noqa: PLC0415
        jax.config.update("jax_compilation_cache_dir", path)
        if path == default_dir():
            jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)

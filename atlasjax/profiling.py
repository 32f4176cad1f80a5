"""Device traces of the running engine, as vLLM's `start_profile` / `stop_profile`.

`LLM.start_profile()` ... `LLM.stop_profile()` (or POST /start_profile and /stop_profile on a server started with
`--profiler-dir DIR`) records a jax.profiler trace of everything the process runs meanwhile: the engine's
steps, their kernels and the host's work between them. It lands in DIR/plugins/profile/<time>/ as
`*.xplane.pb` (TensorBoard's profile plugin, XProf) and `perfetto_trace.json.gz` (ui.perfetto.dev). jax's
profiler is one per process: with --data-parallel-size each replica traces into a subdirectory `dp<N>`; in a
multi-host run only process 0 traces. Python calls are left out unless $ATLASJAX_PROFILER_PYTHON=1 (they slow
the host several times over and bury the steps).
"""
from __future__ import annotations

import os

from atlasjax.errors import InvalidRequestError

ENV = "ATLASJAX_PROFILER_DIR"     # as vLLM's VLLM_TORCH_PROFILER_DIR: where traces go when no directory is given
PYTHON_ENV = "ATLASJAX_PROFILER_PYTHON"   # 1: also trace every Python call (slows the host several times over)


def profiler_dir(configured: str | None) -> str | None:
    """The directory traces go to: the engine's setting, else $ATLASJAX_PROFILER_DIR, else None (no profiling)."""
    value = configured if configured is not None else os.environ.get(ENV) or None
    return None if value is None else os.path.abspath(os.path.expanduser(value))


def trace_dir(directory: str | None, configured: str | None) -> str:
    """Where a trace goes: the directory named on the call, else the engine's; InvalidRequestError if neither."""
    where = profiler_dir(directory) if directory is not None else configured
    if where is None:
        raise InvalidRequestError(f"no profiler directory: start the engine with profiler_dir= (--profiler-dir, "
                                  f"${ENV}) or name one")
    return where


class Profiler:
    """One engine's trace, started and stopped between its steps."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self.active: str | None = None     # where the trace being taken goes

    def start(self, directory: str | None = None) -> str:
        """Start a trace into `directory` (default: the engine's profiler directory); returns it."""
        import jax  # noqa: PLC0415
        where = trace_dir(directory, self.directory)
        if self.active is not None:
            raise InvalidRequestError(f"a profile is already being taken (into {self.active}); stop it first")
        try:
            jax.profiler.start_trace(where, create_perfetto_trace=True, profiler_options=_options())
        except RuntimeError as e:          # another trace of this process (jax allows one)
            raise InvalidRequestError(f"cannot start a profile: {e}") from None
        self.active = where
        return where

    def stop(self) -> str:
        """End the trace and write it; returns its directory."""
        import jax  # noqa: PLC0415
        if self.active is None:
            raise InvalidRequestError("no profile is being taken: start one first")
        where, self.active = self.active, None
        jax.profiler.stop_trace()
        return where


def _options():
    """Device activity and the host runtime's events; Python calls only with $ATLASJAX_PROFILER_PYTHON=1 (on an
    H200 they made a 4-request generate take 33.9 s: 1.6 million events, mostly builtins)."""
    import jax  # noqa: PLC0415
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if os.environ.get(PYTHON_ENV, "").lower() in ("1", "true", "on") else 0
    return options

"""A trace-time switch to the jnp references: model code traced inside `reference_kernels()` takes the
reference attention and matmuls even on a GPU, where the Pallas kernels (which have no VJP) would run.
`atlasjax/forward.py` uses it for differentiable forwards; the engine's steps never do."""
from __future__ import annotations

import contextlib
import contextvars

_ACTIVE = contextvars.ContextVar("atlasjax_reference_kernels", default=False)


@contextlib.contextmanager
def reference_kernels():
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    return _ACTIVE.get()


def attention_backend(backend: str) -> str:
    """The attention backend to use: "reference" inside `reference_kernels()`, else `backend`."""
    return "reference" if _ACTIVE.get() else backend

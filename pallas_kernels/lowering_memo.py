"""Each distinct Mosaic GPU kernel lowered once per process (on by default; `ATLASJAX_KERNEL_LOWERING_MEMO=off`
lowers every kernel in every program, as jax does).

jax lowers a Pallas kernel to its Mosaic GPU module anew in every program that calls it. A server's
warm-up lowers ~32 step programs that share the same layer kernels, and one kernel took ~0.75 s to
lower at 8B shapes on an H100: 88% of the ~4.3 s that lowering one decode program took (session 43,
notebooks/gpu_lower_profile.py), which kept a restart from the compilation cache at ~100 s.

`install()` wraps jax's `lower_jaxpr_to_module` (internal: `jax._src.pallas.mosaic_gpu.lowering`) in
a memo keyed on everything the module is made from: the kernel's source and printed jaxpr, the grid,
block, cluster, axis names, operand shapes, compiler params and constants. A kernel whose key differs
in any of these lowers afresh. Each program still serializes the module into its own custom call, as
jax does. Installed only when jax's function has the parameters this was written against (jax 0.11).

Measured on an H100 (session 44, docs/performance.md): every memo answer of an int4 and a bf16 8B
server's warm-up (117 and 72) was the module a fresh lowering makes, bf16 greedy outputs were the
same bit for bit with the memo on and off, and an int4 8B server was ready in 93.6 s (118.6-135.6
without) and restarted on its compilation cache in 56.5 s (97-102).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import threading

import numpy as np

log = logging.getLogger("atlasjax.kernels")

PARAMETERS = ("jax_mesh", "axis_names", "grid", "block", "cluster", "in_shapes", "out_shapes", "jaxpr", "params",
              "consts", "outer_traceback")
_lock = threading.Lock()
_installed = None   # the memoized function once installed


def enabled() -> bool:
    """On unless $ATLASJAX_KERNEL_LOWERING_MEMO is off, 0 or false."""
    return os.environ.get("ATLASJAX_KERNEL_LOWERING_MEMO", "on").strip().lower() not in ("off", "0", "false")


def install() -> bool:
    """Memoize jax's Mosaic GPU kernel lowering unless switched off; True when in place."""
    global _installed
    if not enabled():
        return False
    with _lock:
        if _installed:
            return True
        try:
            from jax._src.pallas.mosaic_gpu import lowering  # noqa: PLC0415
        except ImportError:
            return False
        if tuple(inspect.signature(lowering.lower_jaxpr_to_module).parameters) != PARAMETERS:
            log.info("kernel lowering memo not installed: jax's lower_jaxpr_to_module changed its parameters")
            return False
        _installed = lowering.lower_jaxpr_to_module = memoize(lowering.lower_jaxpr_to_module)
        return True


def stats() -> dict | None:
    """The installed memo's hits and misses so far in this process; None when it is not installed."""
    return dict(_installed.stats) if _installed else None


def memoize(lower):
    """`lower` (jax's lower_jaxpr_to_module) with a memo; the wrapper's `stats` counts hits and misses.
    A kernel whose key cannot be made (an unprintable jaxpr) is lowered as jax would."""
    memo = {}
    stats = {"hits": 0, "misses": 0}

    @functools.wraps(lower)
    def memoized(jax_mesh, axis_names, grid, block, cluster, in_shapes, out_shapes, jaxpr, params, consts=(),
                 outer_traceback=None):
        args = (jax_mesh, axis_names, grid, block, cluster, in_shapes, out_shapes, jaxpr, params, consts)
        try:
            key = kernel_key(*args)
        except Exception:  # noqa: BLE001  (the memo must never stop a lowering)
            return lower(*args, outer_traceback=outer_traceback)
        with _lock:
            result = memo.get(key)
        if result is not None:
            stats["hits"] += 1
            return result
        result = lower(*args, outer_traceback=outer_traceback)
        stats["misses"] += 1
        with _lock:
            return memo.setdefault(key, result)

    memoized.stats = stats
    return memoized


def kernel_key(jax_mesh, axis_names, grid, block, cluster, in_shapes, out_shapes, jaxpr, params, consts):
    """What a kernel's Mosaic GPU module is made from."""
    source = getattr(getattr(jaxpr, "debug_info", None), "func_src_info", None) or ""
    constants = hashlib.sha256()
    for c in consts:
        c = np.asarray(c)
        constants.update(repr((c.shape, c.dtype)).encode())
        constants.update(c.tobytes())
    layout = repr((jax_mesh, axis_names, tuple(grid), tuple(block), tuple(cluster), tuple(in_shapes),
                   tuple(out_shapes), params))
    return source, str(jaxpr), layout, constants.hexdigest()

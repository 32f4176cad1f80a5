"""A device's memory figures for sizing what goes on it (the KV pool, a calibration's whole model).

jax's `Device.memory_stats()` reads them from XLA's allocator. Under the VMM allocator, which XLA takes
for the command-buffer update mode a tensor-parallel server runs with (atlasjax/step_options.py), it
returns None. Then, on a GPU, the CUDA driver tells the device's free and total memory (cuMemGetInfo), and
the limit is the share of it jax's client may take (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set); a
VMM allocator has no fragmentation to report (it maps physical memory into one address range).
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("atlasjax.engine")

DEFAULT_MEM_FRACTION = 0.75     # jax's default share of a GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION)


def memory_stats(device) -> dict | None:
    """`device.memory_stats()` when it has a `bytes_limit`; else, on a GPU, the driver's figures in the same
    keys (`bytes_limit`, `bytes_in_use`); None where neither is known (the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return stats
    if getattr(device, "platform", None) != "gpu":
        return None
    figures = driver_memory(getattr(device, "local_hardware_id", None) or 0)
    if figures is None:
        log.warning("%s reports no memory statistics and the CUDA driver could not be asked", device)
        return None
    free, total = figures
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    return {"bytes_limit": int(fraction * total), "bytes_in_use": total - free}


def driver_memory(ordinal: int) -> tuple[int, int] | None:
    """(free, total) bytes of CUDA device `ordinal` (as this process numbers them), from the driver; None
    without a driver or on any error."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, context = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal):
        return None
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device):   # the context jax's client runs in
        return None
    try:
        if cuda.cuCtxPushCurrent_v2(context):
            return None
        try:
            if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)):
                return None
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(device)
    return free.value, total.value

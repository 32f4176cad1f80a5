"""XLA options for tensor-parallel GPU steps: one CUDA graph per device, launched without re-recording.

XLA runs each GPU's share of a step as command buffers (CUDA graphs). Two defaults cost a
tensor-parallel decode step most of its host time (docs/tensor_parallel.md, session 16):
- its one-shot all-reduce kernels are launched outside the graphs, so a step with 65 all-reduces
  becomes ~65 graphs per GPU, each launched by the host. Fix, per compiled step
  (`step_compiler_options`): NCCL all-reduces (`xla_gpu_experimental_use_collective_kernels`
  empty), which command buffers capture (`COLLECTIVES`).
- each launch re-records the whole graph (~2 ms per GPU) because the step's temporary buffer
  lands at a new address. Fix: `xla_gpu_command_buffer_update_mode=SKIP_TEMP` (XLA maps the
  temporaries at a stable virtual address). XLA reads this one only from XLA_FLAGS, when the
  backend starts: `use_process_flags` adds it there if the backend has not started yet.

One-device steps keep XLA's defaults: they have no collectives, and SKIP_TEMP measured no better
there. `ATLASJAX_STEP_XLA_OPTIONS=off` turns all of this off, to compare against XLA's defaults.
`ATLASJAX_STEP_XLA_OPTIONS="name=value;..."` adds XLA debug options to every compiled step instead
(for A/B measurements of options that XLA_FLAGS does not take, e.g.
`xla_gpu_experimental_force_split_k=1`).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("atlasjax.compile")

# XLA's default command-buffer command types, plus collectives.
_COMMAND_BUFFER_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,COLLECTIVES"

TENSOR_PARALLEL_GPU = {
    "xla_gpu_enable_command_buffer": _COMMAND_BUFFER_TYPES,
    "xla_gpu_experimental_use_collective_kernels": "",   # NCCL all-reduce: capturable in a graph
    "xla_gpu_graph_min_graph_size": 1,                     # no segment is too small to capture
}
UPDATE_MODE_FLAG = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"


def _off() -> bool:
    return os.environ.get("ATLASJAX_STEP_XLA_OPTIONS", "").lower() in ("off", "0", "false")


def _extra() -> dict:
    """The options named in ATLASJAX_STEP_XLA_OPTIONS ("name=value;..."; true / false / integers typed)."""
    spec = os.environ.get("ATLASJAX_STEP_XLA_OPTIONS", "")
    if "=" not in spec:
        return {}
    options = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, value = item.partition("=")
        typed = {"true": True, "false": False}.get(value.lower(), value)
        options[name.strip()] = int(typed) if isinstance(typed, str) and typed.lstrip("-").isdigit() else typed
    return options


def step_compiler_options(platform: str, num_devices: int) -> dict:
    """The `compiler_options` for a step running on `num_devices` devices of `platform`."""
    # jax reports CUDA devices as "gpu" through a shim it marks temporary; "cuda" is the raw name
    named = _extra()
    if named:
        return named
    if not _off() and platform in ("gpu", "cuda") and num_devices > 1:
        return dict(TENSOR_PARALLEL_GPU)
    return {}


def use_process_flags(tensor_parallel_size: int) -> bool:
    """Before the jax backend starts: add the process-wide flag tensor parallelism wants to XLA_FLAGS
    (harmless off GPU). Returns whether it is in effect; a user's own update mode is left alone."""
    if tensor_parallel_size <= 1 or _off():
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_command_buffer_update_mode" in flags:
        return UPDATE_MODE_FLAG in flags
    from jax._src import xla_bridge  # noqa: PLC0415
    if xla_bridge.backends_are_initialized():
        log.info("jax started before the engine: tensor-parallel steps run without %s (set it in XLA_FLAGS "
                 "to save ~1-2 ms of host time per launch)", UPDATE_MODE_FLAG)
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {UPDATE_MODE_FLAG}".strip()
    return True

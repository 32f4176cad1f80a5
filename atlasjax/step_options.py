"""XLA options the engine compiles its steps with: keep a tensor-parallel step in one CUDA graph.

XLA runs each GPU's share of a step as command buffers (CUDA graphs). Two defaults cost a
tensor-parallel decode step most of its host time (docs/tensor_parallel.md, session 16):
- its one-shot all-reduce kernels are launched outside the graphs, so a step with 65 all-reduces
  becomes ~65 graphs per GPU, each launched by the host (`xla_gpu_experimental_use_collective_kernels`
  empty: NCCL all-reduces instead, which command buffers capture (`COLLECTIVES`));
- every launch re-records the graph when the step's temporary buffer lands at a new address
  (`xla_gpu_command_buffer_update_mode=SKIP_TEMP`: XLA maps the temporaries at a stable virtual
  address, so only the commands that touch new inputs or outputs are updated).

On one device neither applies (no collectives; the update mode was not measured to help there), so
single-device steps compile with XLA's defaults. `ATLASJAX_STEP_XLA_OPTIONS=off` turns these off, to
compare against XLA's defaults; XLA_FLAGS still applies to everything these options leave alone.
"""
from __future__ import annotations

import os

# XLA's default command-buffer command types, plus collectives.
_COMMAND_BUFFER_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,COLLECTIVES"

TENSOR_PARALLEL_GPU = {
    "xla_gpu_enable_command_buffer": _COMMAND_BUFFER_TYPES,
    "xla_gpu_experimental_use_collective_kernels": "",   # NCCL all-reduce: capturable in a graph
    "xla_gpu_graph_min_graph_size": 1,                     # no segment is too small to capture
    "xla_gpu_command_buffer_update_mode": "SKIP_TEMP",
}


def step_compiler_options(platform: str, num_devices: int) -> dict:
    """The `compiler_options` for a step running on `num_devices` devices of `platform`."""
    if os.environ.get("ATLASJAX_STEP_XLA_OPTIONS", "").lower() in ("off", "0", "false"):
        return {}
    if platform in ("gpu", "cuda") and num_devices > 1:
        return dict(TENSOR_PARALLEL_GPU)
    return {}

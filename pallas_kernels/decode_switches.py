"""Whether the decode kernels run: the environment switches and the GPUs they measured faster on.

The decode kernel's rules (pallas_kernels/decode_matmul_rules.py) ask these, and so
do the tests, which patch `device_kind` to stand in for a GPU.
"""
from __future__ import annotations

import os

import jax

MEASURED_FASTER_ON = ("H100",)   # device kinds on which whole decode steps measured faster


def enabled() -> bool:
    """`ATLASJAX_DECODE_MATMUL`: unset / "auto" -> on the GPUs in MEASURED_FASTER_ON; "off" -> never
    (XLA's GEMM, for A/B measurements); "on" -> on any GPU. On an H200 (session 19) the kernel
    alone was as fast as XLA's GEMM (8B bs=1, 4 steps per launch: 4.15 against 4.16 ms) and with
    its prologues slower (4.26-4.28): the weight streams 1.4x faster there, and the prologue's
    per-step work no longer hides under it."""
    setting = os.environ.get("ATLASJAX_DECODE_MATMUL", "auto").lower()
    if setting in ("off", "0", "false"):
        return False
    return forced() or any(kind in device_kind() for kind in MEASURED_FASTER_ON)


def forced() -> bool:
    """`ATLASJAX_DECODE_MATMUL=on`: the kernel on any GPU."""
    return os.environ.get("ATLASJAX_DECODE_MATMUL", "auto").lower() in ("on", "1", "true")


def device_kind() -> str:
    return jax.devices()[0].device_kind


def wide_setting() -> str:
    """`ATLASJAX_DECODE_MATMUL_WIDE`, for A/B measurements of int8 / fp8 weights wider than the decode
    matmul's MAX_TILES: "auto" (default): from its WIDE_MIN_TILES (the LM head) on; "off": never; "on": any width (gate_up
    too, which made the fp8 step slower: 3.46 against 3.32 ms, session 23); "tail": any width, with
    the tiles past the last full wave split over K (`tail_split_sms`; the fp8 step was slower too:
    3.373 against 3.301 ms, session 24). ("persistent", session 27's persistent gate_up kernel, was
    slower and was removed in session 32.)"""
    return os.environ.get("ATLASJAX_DECODE_MATMUL_WIDE", "auto").lower()


def prologues_on() -> bool:
    """`ATLASJAX_DECODE_PROLOGUE=off`: the norms and SwiGLU stay in XLA, for A/B measurements."""
    return os.environ.get("ATLASJAX_DECODE_PROLOGUE", "").lower() not in ("off", "0", "false")


def int4_mlp_on() -> bool:
    """`ATLASJAX_INT4_MLP=on`: a decode step's MLP on the engine's int4 weights runs as one persistent
    kernel (pallas_kernels/int4_mlp.py) instead of two int4 kernels and XLA's silu x up. Off by
    default: on the H100 the 8B int4 step took 2.35 ms against 2.36-2.37 without it (session 36),
    within run-to-run noise, and its grid barrier needs every block resident at once, which a GPU
    shared with other processes (MPS) may not allow."""
    return os.environ.get("ATLASJAX_INT4_MLP", "off").lower() in ("on", "1", "true")

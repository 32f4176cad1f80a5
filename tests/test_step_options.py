"""The XLA options tensor-parallel GPU steps compile with (atlasjax/step_options.py).

CI has no GPU, so the options cannot change a step here; what can go wrong on CPU is the options
themselves: XLA rejects an unknown option name or enum value only when it compiles, which on the
GPU would be the first tensor-parallel step of a user's server. XLA parses every option into one
DebugOptions proto whatever the platform, so compiling with them on CPU checks each name and value.
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from atlasjax.step_options import TENSOR_PARALLEL_GPU, UPDATE_MODE_FLAG, step_compiler_options, use_process_flags


def test_xla_accepts_every_tensor_parallel_option():
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(compiler_options=TENSOR_PARALLEL_GPU)
    assert compiled(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]
    # the process-wide flag, as a compile option (XLA ignores it there, but parses it the same way)
    name, value = UPDATE_MODE_FLAG.removeprefix("--").split("=")
    jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile(compiler_options={name: value})


def test_xla_rejects_a_misspelt_value():
    # the check above means something: a wrong enum value is an error at compile time
    with pytest.raises(Exception, match="xla_gpu_command_buffer_update_mode"):
        jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(
            compiler_options={"xla_gpu_command_buffer_update_mode": "SKIP_TEMPS"})


@pytest.mark.parametrize("platform,devices,expected", [
    ("gpu", 2, TENSOR_PARALLEL_GPU), ("gpu", 8, TENSOR_PARALLEL_GPU),
    ("gpu", 1, {}), ("cpu", 8, {}), ("tpu", 4, {})])
def test_options_apply_to_multi_gpu_steps_only(platform, devices, expected):
    assert step_compiler_options(platform, devices) == expected


def test_environment_switch_restores_xla_defaults(monkeypatch):
    monkeypatch.setenv("ATLASJAX_STEP_XLA_OPTIONS", "off")
    assert step_compiler_options("gpu", 2) == {}


def test_named_options_replace_the_defaults_on_every_step(monkeypatch):
    # for A/B measurements: options XLA_FLAGS does not take, typed as XLA parses them, on one device too
    monkeypatch.setenv("ATLASJAX_STEP_XLA_OPTIONS", "xla_gpu_exhaustive_tiling_search=true; xla_gpu_experimental_force_split_k=1")
    expected = {"xla_gpu_exhaustive_tiling_search": True, "xla_gpu_experimental_force_split_k": 1}
    assert step_compiler_options("gpu", 1) == expected == step_compiler_options("gpu", 2)
    jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile(compiler_options=expected)


def test_process_flag_not_added_once_the_backend_runs(monkeypatch):
    # Once jax has started the flag can no longer take effect, so it is not added; a user's own
    # choice is always left alone.
    jax.devices()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert not use_process_flags(2)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", UPDATE_MODE_FLAG)
    assert use_process_flags(2)
    assert not use_process_flags(1)


def test_process_flag_in_a_fresh_process():
    # A fresh interpreter: the engine's call comes before the backend starts, so XLA reads the flag.
    code = ("import os, jax; from atlasjax.step_options import use_process_flags; "
            "assert use_process_flags(2); jax.devices(); print(os.environ['XLA_FLAGS'])")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "ATLASJAX_STEP_XLA_OPTIONS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == UPDATE_MODE_FLAG

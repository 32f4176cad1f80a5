"""The XLA options tensor-parallel GPU steps compile with (atlasjax/step_options.py).

CI has no GPU, so the options cannot change a step here; what can go wrong on CPU is the options
themselves: XLA rejects an unknown option name or enum value only when it compiles, which on the
GPU would be the first tensor-parallel step of a user's server. XLA parses every option into one
DebugOptions proto whatever the platform, so compiling with them on CPU checks each name and value.
"""
import jax
import jax.numpy as jnp
import pytest

from atlasjax.step_options import TENSOR_PARALLEL_GPU, step_compiler_options


def test_xla_accepts_every_tensor_parallel_option():
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(compiler_options=TENSOR_PARALLEL_GPU)
    assert compiled(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]


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

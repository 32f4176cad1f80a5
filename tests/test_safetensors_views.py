"""Safetensors read as views of the mapped files (atlasjax/loader.py `MAP_FILE_VIEWS`, on by default on a GPU,
where it takes an 8B's load from the page cache from 16.7 s toward the copy to the device): the loaded weights
equal those read through safetensors' own reader, in float32 and bfloat16, whole and as tensor-parallel slices,
and a truncated file is still refused as a corrupt checkpoint."""
from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from atlasjax import loader
from atlasjax.errors import CheckpointError
from tests.hf_models import make_hf_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    f32 = str(tmp_path_factory.mktemp("f32"))
    model = make_hf_model("llama_gqa4", f32)
    bf16 = str(tmp_path_factory.mktemp("bf16"))
    model.to(torch.bfloat16).save_pretrained(bf16)
    shutil.copy(os.path.join(f32, "config.json"), bf16)
    return {"f32": f32, "bf16": bf16}


def _load(path, views: bool, monkeypatch, mesh=None):
    monkeypatch.setattr(loader, "MAP_FILE_VIEWS", views)
    params = loader.load_model(path, jnp.float32, mesh=mesh).params
    return [np.asarray(x) for x in jax.tree.leaves(params)]


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_views_load_the_same_weights(checkpoints, kind, monkeypatch):
    want = _load(checkpoints[kind], False, monkeypatch)
    got = _load(checkpoints[kind], True, monkeypatch)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_views_load_the_same_tensor_parallel_slices(checkpoints, monkeypatch):
    from atlasjax.sharding import make_mesh
    want = _load(checkpoints["bf16"], False, monkeypatch, make_mesh(2))
    got = _load(checkpoints["bf16"], True, monkeypatch, make_mesh(2))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_a_truncated_file_is_refused(checkpoints, tmp_path, monkeypatch):
    broken = str(tmp_path / "broken")
    shutil.copytree(checkpoints["bf16"], broken)
    weights = os.path.join(broken, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 1024)
    monkeypatch.setattr(loader, "MAP_FILE_VIEWS", True)
    with pytest.raises(CheckpointError):
        loader.load_model(broken, jnp.float32)

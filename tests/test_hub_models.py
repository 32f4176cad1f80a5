"""Hugging Face Hub model ids (`LLM("org/name")`, `--model org/name`), as vLLM takes them (atlasjax/hub.py).

CI has no network, so the Hub here is the local Hugging Face cache in its real layout
(models--org--name/refs/main, snapshots/<commit>/) with HF_HUB_OFFLINE=1: the lookup a machine makes once the
model was downloaded. What a user notices: the id loads and answers as the directory does, the server names the
model by the id, and an id found nowhere is one clear error.
"""
from __future__ import annotations

import os
import shutil

import pytest

from atlasjax import LLM
from atlasjax.errors import EngineConfigError
from atlasjax.hub import is_hub_id, resolve
from serving.cli import served_model_name
from tests.server_util import ENGINE_KWARGS, greedy_reference, reference_llm, tiny_model_dir

REPO = "atlasjax-test/tiny-llama3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, tmp_path_factory, monkeypatch):
    """The tiny model as the Hugging Face cache holds a downloaded repository; offline, as CI is."""
    repo = tmp_path / "hub" / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny_model_dir(tmp_path_factory), repo / "snapshots" / COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / COMMIT


def test_a_hub_id_loads_from_the_cache_and_answers_as_its_directory(hub_cache, tmp_path_factory):
    assert resolve(REPO) == str(hub_cache)
    llm = LLM(REPO, **ENGINE_KWARGS)
    assert llm.engine.config.model == str(hub_cache)
    prompts = ["The capital of France is", "Once upon a time"]
    want = greedy_reference(reference_llm(tmp_path_factory), prompts, 6)
    got = greedy_reference(llm, prompts, 6)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert LLM(REPO, tokenizer=REPO, load_format="dummy", **ENGINE_KWARGS).engine.config.tokenizer == str(hub_cache)


def test_an_id_found_nowhere_is_one_clear_error(hub_cache):
    with pytest.raises(EngineConfigError, match=r"'nobody/no-such-model' is not a local path.*HF_HUB_OFFLINE"):
        LLM("nobody/no-such-model", **ENGINE_KWARGS)
    assert resolve(REPO, revision=COMMIT) == str(hub_cache)          # a commit the cache holds
    with pytest.raises(EngineConfigError, match="at revision 'v2'"):
        LLM(REPO, revision="v2", **ENGINE_KWARGS)                     # a tag it does not


def test_paths_win_over_ids_and_the_server_names_a_model_by_its_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("org/local")
    assert not is_hub_id("org/local")                   # an existing path is a path
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("meta-llama/Llama-3.1-8B-Instruct")
    for name in ("/abs/dir", "a/b/c", "single", "org/model.gguf", "./x", ""):
        assert not is_hub_id(name), name
    assert resolve("org/local") == "org/local"
    assert served_model_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"          # vLLM's served name for an id
    assert served_model_name("org/local") == "local"                        # a directory: its name
    assert served_model_name(str(tmp_path / "m.gguf")) == "m"

"""Bad input gets a clear exception type and message, and leaves the engine usable."""
import shutil

import pytest

from atlasjax import (LLM, CheckpointError, EngineConfigError, InvalidRequestError, SamplingParams,
                      UnsupportedModelError)
from atlasjax.config import from_hf_config


def test_unknown_architecture_names_it_and_lists_supported():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*Supported: LlamaForCausalLM"):
        from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor(hf_model_factory, tmp_path):
    from safetensors.numpy import load_file, save_file
    d = _copy(hf_model_factory("llama_gqa4")[1], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing 1 tensor.*layers_1/mlp/down_proj"):
        LLM(str(d), max_model_len=64)


def test_misshaped_and_unexpected_tensors(hf_model_factory, tmp_path):
    from safetensors.numpy import load_file, save_file
    d = _copy(hf_model_factory("llama_gqa4")[1], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm.weight.*shape"):
        LLM(str(d), max_model_len=64)
    tensors = load_file(_copy(hf_model_factory("llama_gqa4")[1], tmp_path / "n") / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "n" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.extra.weight'"):
        LLM(str(tmp_path / "n"), max_model_len=64)


def test_truncated_safetensors(hf_model_factory, tmp_path):
    d = _copy(hf_model_factory("llama_gqa4")[1], tmp_path / "m")
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(d), max_model_len=64)


def test_unsupported_file_and_missing_path(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(UnsupportedModelError):
        LLM(str(tmp_path / "model.bin"))
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(tmp_path / "nothing-here"))


def test_pool_too_small_for_one_sequence(hf_model_factory):
    with pytest.raises(EngineConfigError, match="cannot hold one sequence"):
        LLM(hf_model_factory("llama_gqa4")[1], max_model_len=256, page_size=16, num_pages=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n must"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=99), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_overlong_prompt_is_rejected_and_engine_keeps_working(hf_model_factory):
    llm = LLM(hf_model_factory("llama_gqa4")[1], max_model_len=64, max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="more than max_model_len=64"):
        llm.generate([list(range(1, 100))])
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len"):
        llm.generate([[1, 2, 3], list(range(1, 50))], SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[1, 2, 100000]])
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages and not llm.engine.has_unfinished()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4

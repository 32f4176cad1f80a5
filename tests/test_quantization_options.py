"""Quantizing at load with another group size or without zero points (`quantization_group_size`,
`quantization_symmetric`; `--quantization-group-size`, `--quantization-symmetric`): the weights take
that layout, serve, and keep it through `LLM.save`; settings a format cannot take are refused."""
from __future__ import annotations

import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError
from tests.server_util import tiny_model_dir

KW = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, dtype="float32")
PROMPT = "One two three"


def _down(llm):
    return llm.engine.runner.checkpoint_params()["layers_0"]["mlp"]["down_proj"]["kernel"]


def test_int4_groups_of_32_without_zero_points_serve_and_save(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory)
    llm = LLM(model, quantization="int4", quantization_group_size=32, quantization_symmetric=True, **KW)
    leaf = _down(llm)
    assert (leaf.format, leaf.group_size, leaf.zeros, leaf.zero_point) == ("int4", 32, None, False)
    assert "int4 g32" in llm.engine.weights_summary
    greedy = SamplingParams(temperature=0, max_tokens=6)
    out = llm.generate(PROMPT, greedy)[0].outputs[0]
    assert len(out.token_ids) == 6
    saved = str(tmp_path_factory.mktemp("int4_g32_sym"))
    llm.save(saved)
    again = LLM(saved, **KW)
    leaf = _down(again)
    assert (leaf.group_size, leaf.zeros) == (32, None)
    assert again.generate(PROMPT, greedy)[0].outputs[0].token_ids == out.token_ids
    default = _down(LLM(model, quantization="int4", **KW))   # the default: groups of 128 with zero points
    assert default.group_size == 128 and default.zeros is not None


def test_int8_with_groups(tmp_path_factory):
    llm = LLM(tiny_model_dir(tmp_path_factory), quantization="int8", quantization_group_size=64, **KW)
    leaf = _down(llm)
    assert (leaf.format, leaf.group_size) == ("int8", 64)
    assert len(llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="fp8", quantization_group_size=32), "fp8"),
    (dict(quantization="int8", quantization_symmetric=False), "symmetric"),
    (dict(quantization="int4", quantization_group_size=24), "power of two"),
    (dict(quantization="int4", quantization_group_size=8), "power of two"),
    (dict(quantization_group_size=32), "need quantization"),
    (dict(quantization_symmetric=True), "need quantization")])
def test_settings_a_format_cannot_take_are_refused(kwargs, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(**kwargs)


def test_cli_flags_reach_the_engine():
    from atlasjax.__main__ import build_parser, engine_kwargs
    args = build_parser().parse_args(["generate", "x", "--quantization", "int4", "--quantization-group-size", "64",
                                      "--quantization-symmetric"])
    kw = engine_kwargs(args)
    assert (kw["quantization_group_size"], kw["quantization_symmetric"]) == (64, True)
    assert engine_kwargs(build_parser().parse_args(["generate", "x"]))["quantization_symmetric"] is None
    kw = engine_kwargs(build_parser().parse_args(["serve", "--model", "x", "--quantization", "fp8",
                                                  "--activation-quantization", "fp8"]))
    assert (kw["quantization"], kw["activation_quantization"]) == ("fp8", "fp8")
    kw = engine_kwargs(build_parser().parse_args(["generate", "x", "--quantization", "int8",
                                                  "--activation-quantization", "int8"]))
    assert (kw["quantization"], kw["activation_quantization"]) == ("int8", "int8")
    assert engine_kwargs(build_parser().parse_args(["generate", "x"]))["activation_quantization"] is None

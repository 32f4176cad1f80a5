"""What a model is loaded with besides its weights file: vLLM's `--load-format dummy` and `--tokenizer`.

load_format="dummy": a directory holding only a config.json (and, where it has them, tokenizer files) builds
an engine that generates; the same seed gives the same weights, at TP=2 too; a quantized format quantizes
them as they are made; the tokenizer beside the config is the one used; a directory without a config.json and
an unknown format are refused with the reason. tokenizer=DIR: that tokenizer instead of the model's, refused
when absent or larger than the model's vocabulary.
"""
from __future__ import annotations

import os
import shutil

import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.errors import AtlasJaxError, EngineConfigError
from tests.hf_models import BASE, TP_CASES

ENGINE = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, dtype="float32")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> str:
    cls, overrides = TP_CASES["qwen2_tp"]      # 8 query heads, 2 KV heads: splits over 2 devices
    d = str(tmp_path_factory.mktemp("config_only"))
    cls(**{**BASE, **overrides}).save_pretrained(d)
    assert os.listdir(d) == ["config.json"]
    return d


def _tokens(llm, params=GREEDY):
    return list(llm.generate([PROMPT], params)[0].outputs[0].token_ids)


def test_a_config_alone_serves_with_random_weights(config_only):
    with pytest.raises(AtlasJaxError):
        LLM(config_only, **ENGINE)        # the default format wants the weights
    llm = LLM(config_only, load_format="dummy", **ENGINE)
    assert llm.engine.weights_summary.endswith("(random: load_format dummy)")
    tokens = _tokens(llm)
    assert len(tokens) == 8 and all(0 <= t < 500 for t in tokens)
    assert _tokens(LLM(config_only, load_format="dummy", **ENGINE)) == tokens          # the seed fixes the weights
    other = LLM(config_only, load_format="dummy", seed=1, **ENGINE)
    logprob = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    assert other.generate([PROMPT], logprob)[0].outputs[0].cumulative_logprob != \
        llm.generate([PROMPT], logprob)[0].outputs[0].cumulative_logprob


def test_dummy_weights_split_over_two_devices_are_the_same(config_only):
    one = _tokens(LLM(config_only, load_format="dummy", **ENGINE))
    assert _tokens(LLM(config_only, load_format="dummy", tensor_parallel_size=2, **ENGINE)) == one


def test_dummy_weights_quantize_as_they_are_made(config_only):
    llm = LLM(config_only, load_format="dummy", quantization="int8", **ENGINE)
    assert "int8" in llm.engine.weights_summary
    assert len(_tokens(llm)) == 8


def _need_llama3_tokenizer() -> str:
    from tests.server_util import TOKENIZER_DIR
    if not os.path.exists(os.path.join(TOKENIZER_DIR, "tokenizer.json")):
        pytest.skip(f"test assets not found at {TOKENIZER_DIR} (the Llama 3 tokenizer)")
    return TOKENIZER_DIR


def test_the_tokenizer_beside_the_config_is_kept(tmp_path):
    TOKENIZER_DIR = _need_llama3_tokenizer()
    cls, overrides = TP_CASES["qwen2_tp"]
    cls(**{**BASE, **overrides, "vocab_size": 128256}).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", **ENGINE)
    import tokenizers
    text = "The capital of France is"
    raw = tokenizers.Tokenizer.from_file(os.path.join(TOKENIZER_DIR, "tokenizer.json")).encode(
        text, add_special_tokens=False).ids
    out = llm.generate([text], GREEDY)[0]
    assert len(raw) == 5 and list(out.prompt_token_ids[-5:]) == raw     # Llama 3's own ids for the words
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_what_dummy_cannot_build_is_refused(tmp_path, config_only):
    with pytest.raises(EngineConfigError, match="has none"):
        LLM(str(tmp_path), load_format="dummy", **ENGINE)
    with pytest.raises(EngineConfigError, match="load_format must be one of auto, dummy"):
        LLM(config_only, load_format="random", **ENGINE)
    from atlasjax.__main__ import build_parser, engine_kwargs
    args = build_parser().parse_args(["serve", "--model", config_only, "--load-format", "dummy"])
    assert engine_kwargs(args)["load_format"] == "dummy"


def test_a_tokenizer_given_apart_replaces_the_models(tmp_path, config_only):
    tokenizer_dir = _need_llama3_tokenizer()
    cls, overrides = TP_CASES["qwen2_tp"]
    cls(**{**BASE, **overrides, "vocab_size": 128256}).save_pretrained(tmp_path)     # a config, no tokenizer
    assert LLM(str(tmp_path), load_format="dummy", **ENGINE).tokenizer is None
    llm = LLM(str(tmp_path), load_format="dummy", tokenizer=tokenizer_dir, **ENGINE)
    assert llm.tokenizer.encode("Paris", add_special_tokens=False) == [60704]      # Llama 3's id for "Paris"
    assert llm.generate(["Hello"], GREEDY)[0].outputs[0].text
    with pytest.raises(EngineConfigError, match="128256 tokens; the model's vocabulary has 500"):
        LLM(config_only, load_format="dummy", tokenizer=tokenizer_dir, **ENGINE)
    with pytest.raises(EngineConfigError, match="no tokenizer.json there"):
        LLM(str(tmp_path), load_format="dummy", tokenizer=str(tmp_path / "nowhere"), **ENGINE)

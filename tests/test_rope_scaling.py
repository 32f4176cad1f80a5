"""RoPE scalings (models/rope.py) against Hugging Face's, the context length a model's positions allow
(`ModelConfig.max_positions`), and vLLM's `hf_overrides` setting RoPE over a model's config
(atlasjax/hf_overrides.py). Whole models with yarn against HF: the qwen3_yarn case of test_models_vs_hf.py."""
import dataclasses

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from atlasjax import LLM, SamplingParams
from atlasjax.config import from_hf_config
from atlasjax.engine_config import ALLOW_LONG_MAX_MODEL_LEN, EngineConfig, resolve_max_model_len
from atlasjax.errors import EngineConfigError
from atlasjax.hf_overrides import with_model_overrides
from models.rope import rope_attention_factor, rope_inv_freq
from tests.hf_models import hf_logprobs, make_hf_model

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             max_position_embeddings=40960, rope_theta=1000000.0)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("scaling", [
    YARN,                                                                    # Qwen3 / Qwen2.5 past 32k
    dict(YARN, factor=8.0, beta_fast=16, beta_slow=2, truncate=False),
    dict(YARN, factor=40.0, mscale=1.0, mscale_all_dim=0.707),               # DeepSeek's attention factor
    dict(YARN, factor=2.0, attention_factor=1.5),
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_inverse_frequencies_and_attention_factor_match_hf(scaling):
    hf_config = transformers.Qwen3Config(**{k: v for k, v in QWEN3.items() if k != "architectures"},
                                         rope_scaling=dict(scaling))
    want_inv, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    cfg = from_hf_config(dict(QWEN3, rope_scaling=dict(scaling)))
    np.testing.assert_allclose(np.asarray(rope_inv_freq(cfg)), want_inv.numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(want_factor, rel=1e-6)


def test_a_model_says_how_long_its_positions_reach():
    assert from_hf_config(QWEN3).max_positions == 40960
    assert from_hf_config(dict(QWEN3, rope_scaling=YARN)).max_positions == 131072   # 4 x 32k, as vLLM derives it
    # Qwen2/3 name a window they do not use; Mistral v0.1 uses its 4,096-token one, which we do not apply
    assert from_hf_config(dict(QWEN3, sliding_window=4096, use_sliding_window=False)).max_positions == 40960
    mistral = dict(QWEN3, architectures=["MistralForCausalLM"], sliding_window=4096, max_position_embeddings=32768)
    assert from_hf_config(mistral).max_positions == 4096


def test_max_model_len_past_the_model_is_refused_unless_allowed(monkeypatch):
    cfg = from_hf_config(QWEN3)
    assert resolve_max_model_len(None, cfg) == 4096
    assert resolve_max_model_len(40960, cfg) == 40960
    refusal = f"longer than the model's 40960 tokens.*yarn.*{ALLOW_LONG_MAX_MODEL_LEN}"
    with pytest.raises(EngineConfigError, match=refusal):
        resolve_max_model_len(65536, cfg)
    assert resolve_max_model_len(131072, from_hf_config(dict(QWEN3, rope_scaling=YARN))) == 131072
    mistral = from_hf_config(dict(QWEN3, architectures=["MistralForCausalLM"], sliding_window=4096))
    with pytest.raises(EngineConfigError, match="sliding-window attention spans 4096"):
        resolve_max_model_len(8192, mistral)
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN, "1")
    assert resolve_max_model_len(65536, cfg) == 65536


def test_overrides_set_rope_over_the_models_config():
    cfg = from_hf_config(QWEN3)
    yarn = with_model_overrides(cfg, {"rope_scaling": YARN})
    assert yarn.rope_scaling.rope_type == "yarn" and yarn.max_positions == 131072
    assert dataclasses.replace(yarn, rope_scaling=cfg.rope_scaling) == cfg   # nothing else changed
    theta = with_model_overrides(yarn, {"rope_theta": 500000.0})             # the scaling stays
    assert theta.rope_theta == 500000.0 and theta.rope_scaling == yarn.rope_scaling
    assert with_model_overrides(cfg, {"rope_scaling": {"rope_type": "default"}}).rope_scaling.rope_type == "default"
    mistral = from_hf_config(dict(QWEN3, architectures=["MistralForCausalLM"], sliding_window=4096))
    assert with_model_overrides(mistral, {"use_sliding_window": False}).max_positions == 40960


@pytest.mark.parametrize("overrides, words", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -1.0}}, "factor must be > 0"),
    ({"rope_scaling": "yarn"}, "must be a JSON object"),
    ({"rope_theta": "big"}, "positive number"),
    ({"max_position_embeddings": 0}, "positive whole number"),
    ({"sliding_window": 4096.0}, "positive whole number"),
    ({"use_sliding_window": "no"}, "true or false"),
    ({"num_hidden_layers": 2}, r"\['num_hidden_layers'\] not supported"),
])
def test_bad_overrides_are_refused_before_loading(overrides, words):
    with pytest.raises(EngineConfigError, match=words):
        EngineConfig(hf_overrides=overrides)


def test_yarn_through_overrides_runs_as_hf_with_that_scaling(tmp_path):
    """A model without RoPE scaling, given yarn by --hf-overrides, scores a prompt as HF's model whose config
    carries the same yarn (same weights); and the context the scaling allows is served."""
    import torch
    plain_dir = str(tmp_path / "plain")
    make_hf_model("qwen3", plain_dir)
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    config = transformers.AutoConfig.from_pretrained(plain_dir)
    config.rope_parameters = dict(scaling, rope_theta=config.rope_parameters["rope_theta"])
    hf_yarn = transformers.AutoModelForCausalLM.from_pretrained(plain_dir, config=config, dtype=torch.float32)
    with pytest.raises(EngineConfigError, match="longer than the model's 1024 tokens"):
        LLM(plain_dir, max_model_len=1025, max_num_seqs=1)
    llm = LLM(plain_dir, hf_overrides={"rope_scaling": scaling}, max_model_len=1024, max_num_seqs=1,
              max_num_batched_tokens=128)
    prompt = [int(t) for t in np.random.RandomState(3).randint(0, 512, size=300)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1))[0]
    ref = hf_logprobs(hf_yarn, prompt)
    got = np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    np.testing.assert_allclose(got, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    plain = hf_logprobs(transformers.AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32), prompt)
    assert np.abs(plain[np.arange(len(prompt) - 1), prompt[1:]] - got).max() > 1e-2   # yarn did change the model


def test_the_bench_takes_overrides_and_names_a_refusal(capsys):
    from atlasjax.bench.__main__ import build_parser, main
    from atlasjax.bench.presets import build_engine
    flags = ["latency", "--preset", "tiny", "--input-len", "5000", "--output-len", "2", "--batch-size", "1",
             "--num-iters", "1"]
    assert main(flags) == 2
    assert "error: max_model_len 5002 is longer than the model's 4096 tokens" in capsys.readouterr().err
    args = build_parser().parse_args(flags + ["--hf-overrides", '{"rope_scaling": {"rope_type": "yarn", "factor": 2}}'])
    engine = build_engine(args, max_model_len=5002, num_pages=320)
    assert engine.model_config.rope_scaling.rope_type == "yarn" and engine.max_model_len == 5002


def test_a_gguf_yarn_without_its_original_length_takes_the_model_positions():
    """What atlasjax/gguf_loader.py gives for a yarn file that names no original context: HF's default."""
    cfg = from_hf_config(dict(QWEN3, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": None}))
    assert cfg.rope_scaling.original_max_position_embeddings == 40960 and cfg.max_positions == 4 * 40960


def test_the_command_line_takes_overrides_and_vllm_style_lengths():
    import argparse

    from atlasjax.__main__ import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    overrides = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'
    kw = engine_kwargs(p.parse_args(["--hf-overrides", overrides, "--max-model-len", "128K"]))
    assert kw["max_model_len"] == 131072
    assert EngineConfig(**kw).hf_overrides["rope_scaling"]["rope_type"] == "yarn"
    for text, tokens in (("4096", 4096), ("32k", 32000), ("25.6k", 25600), ("1M", 1024 ** 2)):
        assert p.parse_args(["--max-model-len", text]).max_model_len == tokens
    for bad in ("lots", "1.5", "0", "-2k"):
        with pytest.raises(SystemExit):
            p.parse_args(["--max-model-len", bad])

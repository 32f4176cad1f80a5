"""Checkpoints saved quantized (FP8, AWQ, GPTQ) against transformers on the weights they mean."""
import json
import logging

import numpy as np
import pytest
import torch
import transformers

from atlasjax import LLM, SamplingParams
from atlasjax.errors import EngineConfigError, UnsupportedModelError
from atlasjax.prequantized import scheme_of
from tests.hf_models import hf_logprobs
from tests.prequantized_writers import CONFIGS, write_prequantized

# hidden 256, intermediate 320: several 64-row groups along K, and FP8 blocks of 128 that end short
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
# format -> (kept format, its group along K; None: per channel), or None: dequantized to floats
KEPT = {"fp8-channel": ("fp8", None), "fp8-block": ("fp8", 128), "fbgemm-fp8": ("fp8", None),
        "awq": ("int4", 64), "awq-g32": ("int4", 32), "gptq": ("int4", 64), "gptq-8bit": ("int8", 32),
        "gptq-act-order": None, "ct-w4a16": ("int4", 64), "ct-w4a16-asym": ("int4", 64),
        "ct-w8a8-int": ("int8", None)}


def _model(seed=0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(KEPT))
def saved(request, tmp_path_factory):
    model = _model()
    path = str(tmp_path_factory.mktemp(request.param))
    write_prequantized(model, path, request.param)   # the model now holds the weights the files mean
    return request.param, model, path


def test_loads_kept_and_matches_transformers_on_the_same_weights(saved, caplog):
    fmt, hf, path = saved
    with caplog.at_level(logging.WARNING, logger="atlasjax.prequantized"):
        llm = LLM(path, max_num_seqs=2, max_model_len=128, page_size=16)
    layer = llm.engine.runner.params["layers_1"]
    down = layer["mlp"]["down_proj"]["kernel"]
    if KEPT[fmt] is None:   # act-order groups: not contiguous along K, so floats, and said so
        assert not hasattr(down, "qweight")
        assert sum("dequantized to floats" in r.getMessage() for r in caplog.records) == 1   # once per load
    else:
        want_format, want_group = KEPT[fmt]
        assert down.format == want_format
        assert down.num_groups == 1 if want_group is None else down.group_size == want_group
        assert (down.zeros is not None) == (fmt in ("awq", "awq-g32", "gptq", "ct-w4a16-asym"))   # asymmetric writers
        assert not any(r.levelno >= logging.WARNING for r in caplog.records)
    prompt = [int(t) for t in np.random.RandomState(1).randint(0, 512, size=21)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
                                                prompt_logprobs=1))[0]
    full = prompt + out.outputs[0].token_ids
    ref = hf_logprobs(hf, full)
    got = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    got += [lp[tok].logprob for lp, tok in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    want = [ref[i - 1, full[i]] for i in range(1, len(full))]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_fp8_checkpoint_can_be_quantized_again_at_load(tmp_path):
    model = _model(seed=1)
    write_prequantized(model, str(tmp_path), "fp8-block")
    llm = LLM(str(tmp_path), max_num_seqs=2, max_model_len=128, quantization="int8")
    down = llm.engine.runner.params["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert down.format == "int8" and down.num_groups == 1   # the engine's per-channel int8, not fp8 blocks
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3}, "3-bit GPTQ"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}},
     "4-bit float weights"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
])
def test_unsupported_methods_are_refused_by_name(config, message):
    with pytest.raises(UnsupportedModelError, match=message):
        scheme_of(config)


def test_unsupported_checkpoint_fails_cleanly_through_the_api(tmp_path):
    model = _model()
    write_prequantized(model, str(tmp_path), "awq")
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    config_path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'hqq'.*supported: compressed-tensors"):
        LLM(str(tmp_path), max_num_seqs=2, max_model_len=128)


def test_every_written_format_has_a_config():
    assert set(KEPT) == set(CONFIGS)


@pytest.mark.parametrize("n,k", [(300, 64), (64, 300), (96, 512)])   # one block along K, along N, or several
def test_fp8_block_scales_cover_every_block_shape(n, k):
    import ml_dtypes

    from atlasjax.prequantized import _fp8
    from atlasjax.quantization import dequantize
    from tests.prequantized_writers import _fp8_block
    w = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    saved, meaning = _fp8_block(w, None)
    arrays = {"weight": saved["weight"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn),
              "weight_scale_inv": saved["weight_scale_inv"].numpy()}
    qw = _fp8(arrays, (n, k))
    np.testing.assert_allclose(np.asarray(dequantize(qw)).T, meaning, rtol=1e-6, atol=1e-7)


def test_awq_checkpoint_saved_with_orbax_loads_back_the_same(tmp_path):
    # read once from the AWQ layout, then `LLM.save`: the engine's own checkpoint keeps the int4 groups
    model = _model(seed=2)
    write_prequantized(model, str(tmp_path / "awq"), "awq")
    llm = LLM(str(tmp_path / "awq"), max_num_seqs=2, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    ref = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0]
    llm.save(str(tmp_path / "saved"))
    again = LLM(str(tmp_path / "saved"), max_num_seqs=2, max_model_len=128)
    down = again.engine.runner.checkpoint_params()["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert (down.format, down.group_size, down.zero_point) == ("int4", 64, True)
    out = again.generate([[5, 6, 7, 8]], params)[0].outputs[0]
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)],
                               [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids)], atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8-channel", "fbgemm-fp8", "fp8-block", "ct-w8a8-int"])
def test_checkpoints_made_for_8bit_activations(tmp_path, caplog, fmt):
    """FP8 and int8 W8A8 checkpoints are W8A8 by design. They load as W8A16 and say how to get 8-bit
    activations; per-channel ones take them when asked (a long prompt reaches the W8A8 products),
    block-scaled ones cannot and say so, before anything compiles."""
    acts = "int8" if fmt == "ct-w8a8-int" else "fp8"
    write_prequantized(_model(), str(tmp_path), fmt)
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, 512, size=300)]
    with caplog.at_level(logging.INFO, logger="atlasjax.prequantized"):
        plain = LLM(str(tmp_path), max_num_seqs=2, max_model_len=512, max_num_batched_tokens=512)
    hint = [r.getMessage() for r in caplog.records if f"made for {acts} activations" in r.getMessage()]
    assert hint, "the checkpoint's W8A8 design is not mentioned"
    assert "activations" not in plain.engine.weights_summary
    if fmt == "fp8-block":
        assert "fp8 activations take weights with one scale per channel only" in hint[0]
        with pytest.raises(EngineConfigError, match="needs fp8 weights with one scale per output channel"):
            LLM(str(tmp_path), max_num_seqs=2, max_model_len=512, activation_quantization="fp8")
        return
    assert f"--activation-quantization {acts}" in hint[0]
    w8a8 = LLM(str(tmp_path), max_num_seqs=2, max_model_len=512, max_num_batched_tokens=512,
               activation_quantization=acts)
    assert f"{acts} per channel ({acts} activations)" in w8a8.engine.weights_summary
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)

    def prompt_logprobs(llm):
        out = llm.generate([prompt], params)[0]
        return np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    a, b = prompt_logprobs(plain), prompt_logprobs(w8a8)
    assert not np.array_equal(a, b)                  # the activations were rounded ...
    assert np.abs(a - b).mean() < 0.05 * np.abs(a).mean()   # ... by 8 bits' few percent, not more

"""Smoothing before int8 W8A8 at load (atlasjax/smoothing.py): the migration leaves the float model's
function as it was, folds into every kind of layer it meets (norms, Qwen2's biases, Qwen3's q/k norms
after it), skips what it cannot fold, and makes int8 activations cost far less on the embedded model.
"""
import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM
from atlasjax.engine_config import EngineConfig
from atlasjax.model_source import smooths_int8_activations
from atlasjax.quantization import quantize_params, with_activations
from atlasjax.smoothing import input_amax, smooth, smoothing_factors
from tests.hf_models import make_hf_model
from tests.test_kv_scales import _load, _logprobs, _prompts


def test_factors_follow_the_formula_and_leave_dead_channels_alone():
    x = np.array([4.0, 0.0, 1.0, np.inf, 9.0])
    w = np.array([1.0, 2.0, 0.0, 1.0, 0.25])
    s = smoothing_factors(x, w, alpha=0.5)
    np.testing.assert_allclose(s, [2.0, 1.0, 1.0, 1.0, 3.0 / 0.5], rtol=1e-6)
    np.testing.assert_allclose(smoothing_factors([8.0], [0.5], alpha=0.75), [8.0 ** 0.75 / 0.5 ** 0.25], rtol=1e-6)


@pytest.mark.parametrize("name", ["llama_gqa4", "qwen2", "qwen3"])
def test_smoothing_keeps_the_float_model(name, tmp_path):
    """Norm scales / s, the rows that read them * s, up_proj's columns / s, down's rows * s: every
    layer's qkv, gate_up and down inputs smoothed, the logprobs as they were."""
    model = make_hf_model(name, str(tmp_path))
    loaded = _load(str(tmp_path), "auto")
    cfg = loaded.config
    amax = input_amax(cfg, loaded.params, _prompts(cfg.vocab_size, (40,))[0], jnp.float32)
    assert sorted(amax) == [(i, g) for i in range(cfg.num_layers) for g in range(3)]
    params, groups = smooth(loaded.params, amax)
    assert groups == 3 * cfg.num_layers
    before, after = loaded.params["layers_0"], params["layers_0"]
    assert not np.allclose(after["input_layernorm"]["scale"], before["input_layernorm"]["scale"])
    assert not np.allclose(after["mlp"]["down_proj"]["kernel"], before["mlp"]["down_proj"]["kernel"])
    smoothed = dataclasses.replace(loaded, params=params)
    prompts = _prompts(model.config.vocab_size, (24, 40))
    for got, want in zip(_logprobs(smoothed, prompts), _logprobs(loaded, prompts)):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_smoothing_skips_weights_already_quantized(tmp_path):
    make_hf_model("llama_gqa4", str(tmp_path))
    loaded = _load(str(tmp_path), "auto")
    amax = input_amax(loaded.config, loaded.params, list(range(1, 30)), jnp.float32)
    quantized = quantize_params(loaded.params, "int8")
    params, groups = smooth(quantized, amax)
    assert groups == 0 and all(params[key] is quantized[key] for key in quantized)


def test_only_int8_weights_quantized_at_load_for_int8_activations_in_one_process_are_smoothed():
    assert smooths_int8_activations(EngineConfig(quantization="int8", activation_quantization="int8"))
    assert not smooths_int8_activations(EngineConfig(quantization="int8"))
    assert not smooths_int8_activations(EngineConfig(quantization="fp8", activation_quantization="fp8"))
    assert not smooths_int8_activations(EngineConfig(activation_quantization="int8"))   # a checkpoint's own
    # tensor parallelism in one process too (tests/test_tensor_parallel.py); not across hosts
    assert smooths_int8_activations(EngineConfig(quantization="int8", activation_quantization="int8",
                                                 tensor_parallel_size=2))


KL_SMOOTHED_AT_MOST = 0.5   # of the unsmoothed W8A8's KL (measured 0.0078 against 0.0237 on SmolLM2)


def test_smoothing_more_than_halves_what_int8_activations_cost(default_model_path, caplog):
    from tests.test_quantized_models import _full_logprobs
    from tests.test_w8a8 import LONG_TEXT
    base = LLM(default_model_path, max_num_seqs=2, max_model_len=512, keep_gguf_quantized=False)
    ids = base.tokenizer.encode(LONG_TEXT * 2)[:320]
    ref = _full_logprobs(base.engine, ids)

    def kl(engine):
        q = _full_logprobs(engine, ids)
        return float(np.sum(np.exp(ref) * (ref - q), axis=-1).mean())
    with caplog.at_level(logging.INFO, logger="atlasjax.smoothing"):
        smoothed = LLM(default_model_path, max_num_seqs=2, max_model_len=512, quantization="int8",
                       activation_quantization="int8")
    assert any("groups of projections smoothed" in r.getMessage() for r in caplog.records)
    assert "int8 per channel (int8 activations)" in smoothed.engine.weights_summary
    # the same weights quantized without smoothing, given int8 activations
    plain = LLM(default_model_path, max_num_seqs=2, max_model_len=512, quantization="int8")
    params, _ = with_activations(plain.engine.runner.checkpoint_params(), "int8")
    plain.engine.runner.checkpoint_params = lambda: params
    with_smoothing, without = kl(smoothed.engine), kl(plain.engine)
    print(f"int8 W8A8 mean KL: {with_smoothing:.5f} smoothed, {without:.5f} not")
    assert with_smoothing <= KL_SMOOTHED_AT_MOST * without


def test_a_calibration_that_cannot_fit_one_device_is_refused_before_anything_moves():
    """Under tensor parallelism the calibrations gather the whole model onto the first device; a model
    larger than its free memory gets a clear error instead of running out of memory mid-start."""
    from atlasjax.errors import EngineConfigError
    from atlasjax.model_source import check_fits_one_device

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats
    gib = 2 ** 30
    check_fits_one_device(10 * gib, Device({"bytes_limit": 80 * gib, "bytes_in_use": 8 * gib}))
    check_fits_one_device(10 * gib, Device(None))   # no statistics (the CPU): not checked
    with pytest.raises(EngineConfigError, match="140.0 GiB.*72.0 GiB free"):
        check_fits_one_device(140 * gib, Device({"bytes_limit": 80 * gib, "bytes_in_use": 8 * gib}))

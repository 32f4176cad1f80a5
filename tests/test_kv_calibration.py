"""KV-cache scales computed at start (`calculate_kv_scales`, atlasjax/kv_calibration.py) for an fp8
cache: on a checkpoint without calibrated scales whose K and V reach the thousands, they keep the cache
near-lossless; the folds (powers of two) leave the model's function exactly as it was.

Reuses the big-K/V Llama of tests/test_kv_scales.py (its `big_kv` fixture, without the scale tensors).
"""
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError
from atlasjax.kv_calibration import HEADROOM, power_of_two_scale
from models.layers import is_quantized
from tests.hf_models import make_hf_model
from tests import test_kv_scales
from tests.test_kv_scales import E4M3, KL_WITH_SCALES, _load, _logprobs, _mean_kl, _prompts

big_kv = test_kv_scales.big_kv   # the big-K/V checkpoint fixture, shared

ENGINE = dict(max_num_seqs=2, max_model_len=128)


def _engine_params(llm):
    engine = llm.engine
    return types.SimpleNamespace(config=engine.model_config, params=engine.runner.checkpoint_params())


def test_power_of_two_scales_leave_headroom():
    for amax in (0.013, 1.0, 447.0, 4400.0, 3e7):
        s = power_of_two_scale(amax, 448.0)
        assert s == 2.0 ** round(np.log2(s))
        assert 448.0 / (2 * HEADROOM) < amax / s <= 448.0 / HEADROOM
    assert power_of_two_scale(0.0, 448.0) == power_of_two_scale(float("nan"), 448.0) == 1.0


@pytest.mark.parametrize("layout", ["fp8", "int4", "int4-symmetric", "Q4_1", "Q4_K", "Q8_0"])
def test_a_quantized_weight_takes_the_factor_in_its_rows(layout):
    """Per-channel fp8, int4 with zero points or without, GGUF float offsets (Q4_1), two levels (Q4_K)
    and int8 groups (Q8_0): the codes stay, the weight they mean is scaled exactly."""
    from atlasjax.gguf_blocks import like_gguf
    from atlasjax.kv_calibration import scaled
    from atlasjax.quantization import dequantize, quantize
    w = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    qw = (quantize(w, layout) if layout in ("fp8", "int4") else
          quantize(w, "int4", symmetric=True) if layout == "int4-symmetric" else like_gguf(w, layout))
    for factor in (0.25, 8.0):
        out = scaled(qw, factor)
        assert out.qweight is qw.qweight
        np.testing.assert_array_equal(np.asarray(dequantize(out)), np.asarray(dequantize(qw)) * factor)


def test_computed_scales_keep_large_k_and_v_accurate(big_kv, caplog):
    """What a user of a checkpoint without scales notices: its fp8 cache falls apart (K and V saturate
    at 448); with computed scales it is near-lossless."""
    plain, _, prompts, _, _ = big_kv
    with caplog.at_level(logging.INFO, logger="atlasjax.kv_calibration"):
        llm = LLM(plain, kv_cache_dtype="fp8", calculate_kv_scales=True, **ENGINE)
    assert any("scales computed on" in r.getMessage() for r in caplog.records)
    assert {x.dtype for x in jax.tree.leaves(llm.engine.runner.state.kv)} == {jnp.dtype(E4M3)}
    loaded = _engine_params(llm)
    kl = _mean_kl(_logprobs(loaded, prompts), _logprobs(loaded, prompts, E4M3))
    print(f"fp8 KV with computed scales: mean KL {kl:.5f} nats/token")
    assert kl <= KL_WITH_SCALES


def test_computed_scales_preserve_the_model(big_kv):
    """Over a float32 pool the folded params compute what the checkpoint computes (the scales are powers
    of two, so every fold is exact)."""
    plain, _, prompts, _, _ = big_kv
    before = _load(plain, "auto")
    after = _engine_params(LLM(plain, kv_cache_dtype="fp8", calculate_kv_scales=True, **ENGINE))
    k_before = np.asarray(before.params["layers_0"]["self_attn"]["k_proj"]["kernel"])
    k_after = np.asarray(after.params["layers_0"]["self_attn"]["k_proj"]["kernel"])
    ratio = k_before.flat[np.argmax(np.abs(k_before))] / k_after.flat[np.argmax(np.abs(k_before))]
    assert ratio > 1 and ratio == 2.0 ** round(np.log2(ratio))   # K divided by a power of two >= 2
    for got, want in zip(_logprobs(after, prompts), _logprobs(before, prompts)):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("name,kwargs", [("qwen3", {}), ("llama_gqa4", dict(quantization="int4")),
                                         ("qwen2", dict(quantization="fp8"))],
                         ids=["qwen3-norms", "int4-at-load", "qwen2-bias-fp8"])
def test_computed_scales_fold_into_every_kind_of_weight(name, kwargs, tmp_path):
    """q/k norms (Qwen3), quantized weights (their scale rows) and biases (Qwen2) take the factors;
    the model computes what it did."""
    model = make_hf_model(name, str(tmp_path))
    before = _load(str(tmp_path), "auto", **kwargs)
    after = _engine_params(LLM(str(tmp_path), kv_cache_dtype="fp8", calculate_kv_scales=True, **ENGINE, **kwargs))
    if kwargs:
        assert is_quantized(after.params["layers_0"]["self_attn"]["k_proj"]["kernel"])
    prompts = _prompts(model.config.vocab_size, (24, 40))
    for got, want in zip(_logprobs(after, prompts), _logprobs(before, prompts)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_settings_it_cannot_take_are_refused():
    with pytest.raises(EngineConfigError, match="set kv_cache_dtype='fp8'"):
        EngineConfig(calculate_kv_scales=True)
    from atlasjax.__main__ import build_parser, engine_kwargs
    kw = engine_kwargs(build_parser().parse_args(["serve", "--model", "x", "--kv-cache-dtype", "fp8",
                                                  "--calculate-kv-scales"]))
    assert kw["calculate_kv_scales"] and kw["kv_cache_dtype"] == "fp8"


def test_computed_scales_under_tensor_parallelism(big_kv):
    """TP=2 measures the scales on one device's model (its shards gathered) and folds them as one device
    does: every shard holds one device's weights, and the greedy tokens are one device's."""
    from atlasjax import SamplingParams
    plain, _, prompts, _, _ = big_kv
    llms = [LLM(plain, kv_cache_dtype="fp8", calculate_kv_scales=True, tensor_parallel_size=tp, **ENGINE)
            for tp in (1, 2)]
    one, two = (llm.engine.runner.checkpoint_params()["layers_0"]["self_attn"] for llm in llms)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        np.testing.assert_array_equal(np.asarray(two[name]["kernel"]), np.asarray(one[name]["kernel"]))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [[o.outputs[0].token_ids for o in llm.generate([list(map(int, p)) for p in prompts], greedy)]
           for llm in llms]
    assert ids[1] == ids[0]
    assert llms[1].engine.pool.num_free_pages == llms[1].engine.pool.num_pages

"""8-bit activations (W8A8, `activation_quantization="fp8"` / `"int8"`): the product, when it runs,
and what it costs a model.

Per-channel fp8 (int8) weights set to take fp8 (int8) activations multiply products of
`w8a8.MIN_ROWS` rows or more by activations rounded per row to e4m3 (int8); on Hopper, cuBLASLt's
fp8 GEMM (the int8 tensor cores). Fewer rows keep the W8A16 path. The model-level bound is measured
on the embedded SmolLM2 over a prompt long enough to reach it (docs/quantization.md).
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError
from atlasjax.quantization import concat_quantized, dequantize, quantize, slice_quantized, with_activations
from pallas_kernels import w8a8
from pallas_kernels.quant_format import with_mma_order
from pallas_kernels.quantized_matmul import quantized_matmul

ROWS = w8a8.MIN_ROWS
FORMATS = ("fp8", "int8")
# how each format's dot reads in the lowered program: both operands 8-bit (what the 8-bit GEMMs take)
OPERAND_TYPE = {"fp8": "f8E4M3FN>", "int8": "xi8>"}


def _weight(fmt, k, n, seed=0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.05
    return w, dataclasses.replace(quantize(w, fmt), activations=fmt)


def _x(m, k, seed=1):
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float32) - b) / np.linalg.norm(b))


def _rounded_rows(x, fmt):
    """numpy's own rounding of each row to `fmt` at its absmax scale."""
    if fmt == "fp8":
        scale = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-30) / 448.0
        return (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    scale = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-30) / 127.0
    return np.clip(np.rint(x / scale), -127, 127) * scale


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n", [(256, 128), (300, 130)])
def test_product_is_each_row_rounded_to_the_weights_format_times_the_weight(fmt, k, n):
    w, qw = _weight(fmt, k, n)
    x = _x(ROWS, k)
    x[3] = 0.0                                   # a row of zeros stays zeros
    x[5] *= 1e4                                  # rows of any magnitude get their own scale
    y = np.asarray(w8a8.w8a8_matmul(jnp.asarray(x), qw, jnp.float32))
    want = _rounded_rows(x, fmt) @ np.asarray(dequantize(qw), np.float32)
    assert y.shape == (ROWS, n)
    assert _rel(y, want) < 1e-5
    assert not y[3].any()
    exact = x @ w
    w8a16 = x @ np.asarray(dequantize(qw), np.float32)
    # the activations' rounding costs accuracy beyond the weights' own, and stays within 8 bits' bound
    assert _rel(w8a16, exact) < _rel(y, exact) < 0.06


def test_int8_weights_in_mma_order_give_the_same_product():
    # the decode kernels' layout permutes K in blocks of 32; the activation codes are permuted alike
    _, qw = _weight("int8", 320, 96)
    ordered = with_mma_order(qw)
    assert ordered.mma_order and not np.array_equal(ordered.qweight, qw.qweight)
    x = jnp.asarray(_x(ROWS, 320))
    np.testing.assert_array_equal(w8a8.w8a8_matmul(x, ordered, jnp.float32), w8a8.w8a8_matmul(x, qw, jnp.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_matmul_takes_8bit_activations_from_min_rows_on(fmt):
    k, n = 256, 128
    _, qw = _weight(fmt, k, n)
    plain = dataclasses.replace(qw, activations="bf16")
    for m in (1, ROWS - 1):
        x = jnp.asarray(_x(m, k), jnp.bfloat16)
        assert not w8a8.takes_quantized_activations(qw, m)
        np.testing.assert_array_equal(quantized_matmul(x, qw, out_dtype=jnp.float32),
                                      quantized_matmul(x, plain, out_dtype=jnp.float32))
    x = jnp.asarray(_x(ROWS, k), jnp.bfloat16)
    y = quantized_matmul(x, qw)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y, w8a8.w8a8_matmul(x, qw, jnp.bfloat16))
    assert not np.array_equal(np.asarray(y), np.asarray(quantized_matmul(x, plain)))
    dots = [line for line in jax.jit(lambda x: quantized_matmul(x, qw)).lower(x).as_text().splitlines()
            if "dot_general" in line]
    assert any(line.count(OPERAND_TYPE[fmt]) >= 2 for line in dots), dots


def test_only_per_channel_weights_of_the_same_format_take_8bit_activations():
    w = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    params = {"a": {"kernel": quantize(w, "fp8")}, "b": {"kernel": quantize(w, "int8")},
              "c": {"kernel": quantize(w, "int4")}, "d": {"kernel": quantize(w, "int8", group_size=64)},
              "norm": jnp.ones(4)}
    out, count = with_activations(params, "fp8")
    assert count == 1
    assert out["a"]["kernel"].activations == "fp8"
    assert {out[name]["kernel"].activations for name in "bcd"} == {"bf16"}
    assert out["a"]["kernel"].qweight is params["a"]["kernel"].qweight   # shared, not copied
    out, count = with_activations(params, "int8")
    assert count == 1
    assert out["b"]["kernel"].activations == "int8"
    assert {out[name]["kernel"].activations for name in "acd"} == {"bf16"}
    with pytest.raises(ValueError, match="per-channel fp8 or int8"):
        w8a8.w8a8_matmul(jnp.ones((4, 256)), params["c"]["kernel"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_and_split_projections_keep_the_setting(fmt):
    _, qw = _weight(fmt, 256, 256)
    parts = [slice_quantized(qw, 1, 0, 128), slice_quantized(qw, 1, 128, 128)]
    assert all(p.activations == fmt for p in parts)
    assert concat_quantized(parts, 1).activations == fmt


def test_configuration_errors_are_clear(default_model_path):
    with pytest.raises(EngineConfigError, match="None, fp8 or int8"):
        EngineConfig(activation_quantization="int4")
    with pytest.raises(EngineConfigError, match="int4 weights keep bf16 activations"):
        EngineConfig(quantization="int4", activation_quantization="fp8")
    with pytest.raises(EngineConfigError, match="fp8 weights keep bf16 activations .use quantization='int8'"):
        EngineConfig(quantization="fp8", activation_quantization="int8")
    with pytest.raises(EngineConfigError, match="one scale per output channel"):
        EngineConfig(quantization="int8", quantization_group_size=128, activation_quantization="int8")
    # float weights: nothing to take 8-bit activations, said before anything is compiled
    for fmt in FORMATS:
        with pytest.raises(EngineConfigError, match=f"needs {fmt} weights"):
            LLM(default_model_path, max_num_seqs=2, max_model_len=128, keep_gguf_quantized=False,
                activation_quantization=fmt)


# ---- the embedded SmolLM2: what W8A8 costs over a prompt long enough to reach it --------------------

LONG_TEXT = (
    "The history of astronomy is one of the oldest of the natural sciences. Early cultures identified "
    "celestial objects with gods and spirits, and related them to phenomena such as rain, drought, "
    "seasons and tides. Astronomers of the ancient world built instruments to track the motions of the "
    "Sun, the Moon and the planets, and used them to keep calendars and to navigate at sea. In the "
    "sixteenth century Copernicus proposed a model in which the Earth and the planets move around the "
    "Sun; Kepler found that their orbits are ellipses, and Galileo turned a telescope to the sky and saw "
    "the moons of Jupiter and the phases of Venus. Newton then explained all of these motions with one "
    "law of gravitation. Later centuries added spectroscopy and photography, which let astronomers "
    "measure the composition and the speed of stars, and in the twentieth century they learned that "
    "the Milky Way is one galaxy among billions in an expanding universe. ")
# mean nats per position to the float model, W8A8: measured fp8 0.0174 (W8A16 0.0114), int8 0.0078
# (W8A16 0.0017; smoothed at load, atlasjax/smoothing.py: 0.0237 without, tests/test_smoothing.py)
KL_BOUND_W8A8 = {"fp8": 0.025, "int8": 0.012}


@pytest.fixture(scope="module")
def long_ids(default_model_path):
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=512, keep_gguf_quantized=False)
    ids = llm.tokenizer.encode(LONG_TEXT * 2)[:320]
    assert len(ids) >= ROWS
    from tests.test_quantized_models import _full_logprobs
    return ids, _full_logprobs(llm.engine, ids)


@pytest.mark.parametrize("fmt", FORMATS)
def test_w8a8_mean_kl_to_the_float_model(default_model_path, long_ids, fmt):
    from tests.test_quantized_models import _full_logprobs
    ids, ref = long_ids
    kl = {}
    for acts in (None, fmt):
        llm = LLM(default_model_path, max_num_seqs=2, max_model_len=512, quantization=fmt,
                  activation_quantization=acts)
        q = _full_logprobs(llm.engine, ids)
        kl[acts] = float(np.sum(np.exp(ref) * (ref - q), axis=-1).mean())
    print(f"mean KL over {len(ids)} positions: {fmt} W8A16 {kl[None]:.5f}, {fmt} W8A8 {kl[fmt]:.5f} nats")
    assert kl[None] < kl[fmt] <= KL_BOUND_W8A8[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_w8a8_engine_answers_after_a_long_prompt(default_model_path, fmt):
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=512, quantization=fmt,
              activation_quantization=fmt)
    assert f"{fmt} activations" in llm.engine.weights_summary
    prompt = LONG_TEXT * 2 + "\n\nQuestion: What is the capital of France?\nAnswer: The capital of France is"
    assert len(llm.tokenizer.encode(prompt)) >= ROWS
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize("fmt", FORMATS)
def test_saved_checkpoint_takes_the_setting_of_the_engine_that_loads_it(default_model_path, tmp_path, fmt):
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=256, quantization=fmt,
              activation_quantization=fmt)
    llm.save(str(tmp_path / fmt))
    del llm
    # the checkpoint holds weights; how activations are multiplied is the loading engine's choice
    plain = LLM(str(tmp_path / fmt), max_num_seqs=2, max_model_len=256)
    assert f"{fmt} per channel" in plain.engine.weights_summary
    assert "activations" not in plain.engine.weights_summary
    w8a8_engine = LLM(str(tmp_path / fmt), max_num_seqs=2, max_model_len=256, activation_quantization=fmt)
    assert f"{fmt} activations" in w8a8_engine.engine.weights_summary


def test_bench_names_the_format():
    from atlasjax.bench.presets import weights_label
    assert weights_label("fp8", False, "fp8") == "fp8 W8A8"
    assert weights_label("fp8", True, "fp8") == "fp8 + LM head W8A8"
    assert weights_label("int8", True, "int8") == "int8 + LM head W8A8"
    assert weights_label("int4", False, "fp8") == "int4"   # 8-bit activations take weights of their format
    assert weights_label("fp8", False, "int8") == "fp8"
    assert weights_label("fp8") == "fp8"

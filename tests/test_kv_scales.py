"""A checkpoint's calibrated KV-cache scales (`k_scale` / `v_scale`) with an fp8 KV cache
(atlasjax/kv_scales.py): folded into the attention weights at load, so K and V past e4m3's 448 fit.

The tiny Llama of tests/hf_models.py is rewritten with K and V made 2000x larger (Wk, Wv times 2000,
Wq, Wo over it: the same function, |k| and |v| in the thousands), as a model whose cache needs its
scales. Logprobs come from test_quantized_models._full_logprobs (the reference attention over a pool
of the given dtype) on the loaded params; loads go through model_source.load_for_engine, as the
engine's do.
"""
import json
import logging
import os
import re
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from atlasjax import LLM, loader
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import CheckpointError, UnsupportedModelError
from atlasjax.model_source import load_for_engine
from tests.hf_models import make_hf_model
from tests.prequantized_writers import FP8_MAX, write_prequantized
from tests.test_quantized_models import _full_logprobs

BLOW_UP = 2000.0      # K and V of the test checkpoint, times this
E4M3 = jnp.float8_e4m3fn
# Mean nats per token of an e4m3 pool against the float32 one, same params, on `_prompts` (measured on
# this CPU: 0.00022 with the scales, 0.22 without them, K and V then saturating at 448)
KL_WITH_SCALES, KL_WITHOUT_SCALES = 0.002, 0.05
# Where each checkpoint layout keeps a layer's K and V scales ("kv": one for both)
LAYOUTS = {
    "llm-compressor": {"k": "self_attn.k_scale", "v": "self_attn.v_scale"},
    "modelopt": {"k": "self_attn.k_proj.k_scale", "v": "self_attn.v_proj.v_scale"},
    "autofp8": {"k": "self_attn.k_proj.output_scale", "v": "self_attn.v_proj.output_scale"},
    "kv_scale": {"kv": "self_attn.kv_scale"},
}


def _prompts(vocab, lengths=(20, 37, 50), seed=3):
    rs = np.random.RandomState(seed)
    return [[int(t) for t in rs.randint(0, vocab, size=n)] for n in lengths]


def _load(path, kv_cache_dtype="fp8", **kwargs):
    return load_for_engine(EngineConfig(model=path, kv_cache_dtype=kv_cache_dtype, **kwargs), jnp.float32)


def _logprobs(loaded, prompts, kv_dtype=jnp.float32):
    """Per prompt, log-softmax at every position of the loaded params over a `kv_dtype` pool."""
    engine = types.SimpleNamespace(model_config=loaded.config,
                                   runner=types.SimpleNamespace(checkpoint_params=lambda: loaded.params))
    return [_full_logprobs(engine, ids, kv_dtype) for ids in prompts]


def _mean_kl(ref, got):
    return float(np.mean([np.sum(np.exp(r) * (r - g), axis=-1).mean() for r, g in zip(ref, got)]))


def _rewrite(src, dst, change=None, extra=None, config=None):
    """A copy of checkpoint `src` into `dst`: tensors times `change[name]`, `extra` tensors added,
    `config` merged into config.json."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name, factor in (change or {}).items():
        tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
    tensors |= {k: torch.as_tensor(v, dtype=torch.float32) for k, v in (extra or {}).items()}
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), dst)
    if config:
        with open(os.path.join(dst, "config.json")) as f:
            merged = json.load(f) | config
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(merged, f)
    return dst


def _scale_tensors(layout, k_scales, v_scales):
    """{name: scale} of each layer's K and V scales in `layout` (LAYOUTS)."""
    names = LAYOUTS[layout]
    out = {}
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        if "kv" in names:
            out[f"model.layers.{i}.{names['kv']}"] = np.asarray(k)
        else:
            out |= {f"model.layers.{i}.{names['k']}": np.asarray(k), f"model.layers.{i}.{names['v']}": np.asarray(v)}
    return out


def _kv_amax(model, prompts):
    """Per layer, the largest |k| and |v| the torch model projects on `prompts` (before RoPE)."""
    amax = {}

    def hook(name):
        return lambda module, inputs, out: amax.__setitem__(name, max(amax.get(name, 0.0), out.abs().max().item()))
    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n.endswith(("k_proj", "v_proj"))]
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    layers = model.config.num_hidden_layers
    return ([amax[f"model.layers.{i}.self_attn.k_proj"] for i in range(layers)],
            [amax[f"model.layers.{i}.self_attn.v_proj"] for i in range(layers)])


@pytest.fixture(scope="module")
def big_kv(tmp_path_factory):
    """(directory without scales, directory with calibrated llm-compressor scales, prompts, k scales,
    v scales): the tiny Llama with K and V BLOW_UP times larger."""
    root = tmp_path_factory.mktemp("kv_scales")
    model = make_hf_model("llama_gqa4", str(root / "base"))
    prompts = _prompts(model.config.vocab_size)
    k_amax, v_amax = _kv_amax(model, prompts)
    change = {}
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        change |= {p + "k_proj.weight": BLOW_UP, p + "q_proj.weight": 1 / BLOW_UP,
                   p + "v_proj.weight": BLOW_UP, p + "o_proj.weight": 1 / BLOW_UP}
    plain = _rewrite(str(root / "base"), str(root / "plain"), change)
    # amax / 448 as calibration tools take it; K's with room for RoPE (which may turn a pair's length
    # into one coordinate, up to sqrt(2) times the largest one)
    k_scales = [a * BLOW_UP * np.sqrt(2) / FP8_MAX for a in k_amax]
    v_scales = [a * BLOW_UP / FP8_MAX for a in v_amax]
    scaled = _rewrite(plain, str(root / "scaled"), extra=_scale_tensors("llm-compressor", k_scales, v_scales))
    return plain, scaled, prompts, k_scales, v_scales


@pytest.fixture(scope="module")
def plain_params(big_kv):
    return _load(big_kv[0], "auto")


def test_scales_keep_large_k_and_v_accurate_in_an_fp8_cache(big_kv, caplog):
    """What a user of such a checkpoint notices: with its scales an fp8 cache is near-lossless; the
    same weights without them saturate K and V at 448 and the model's distributions fall apart."""
    plain, scaled, prompts, _, _ = big_kv
    kls = {}
    for label, path in (("with scales", scaled), ("without scales", plain)):
        with caplog.at_level(logging.INFO, logger="atlasjax.kv_scales"):
            llm = LLM(path, kv_cache_dtype="fp8", max_num_seqs=2, max_model_len=128)
        assert {x.dtype for x in jax.tree.leaves(llm.engine.runner.state.kv)} == {jnp.dtype(E4M3)}
        engine = llm.engine
        loaded = types.SimpleNamespace(config=engine.model_config, params=engine.runner.checkpoint_params())
        kls[label] = _mean_kl(_logprobs(loaded, prompts), _logprobs(loaded, prompts, E4M3))
        print(f"fp8 KV, {label}: mean KL {kls[label]:.5f} nats/token")
    assert sum("folded the checkpoint's KV-cache scales of 2 of 2 layers" in r.getMessage() for r in caplog.records) == 1
    assert kls["with scales"] <= KL_WITH_SCALES
    assert kls["without scales"] >= KL_WITHOUT_SCALES


def test_scales_are_ignored_without_an_fp8_cache(big_kv, plain_params, caplog):
    with caplog.at_level(logging.INFO, logger="atlasjax.kv_scales"):
        loaded = _load(big_kv[1], "auto")
    assert any("unused, as the KV cache is not fp8" in r.getMessage() for r in caplog.records)
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), loaded.params, plain_params.params)
    assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("per_head", [False, True], ids=["per-layer", "per-head"])
def test_folding_preserves_the_model(big_kv, plain_params, per_head, tmp_path):
    """Over a float32 pool the folded params compute what the checkpoint's weights compute."""
    plain, scaled, prompts, k_scales, v_scales = big_kv
    if per_head:   # one scale per KV head (2), different for each
        heads = plain_params.config.num_kv_heads
        k_scales = [s * np.linspace(0.6, 1.7, heads) for s in k_scales]
        v_scales = [s * np.linspace(1.3, 0.8, heads) for s in v_scales]
        scaled = _rewrite(plain, str(tmp_path), extra=_scale_tensors("llm-compressor", k_scales, v_scales))
    folded = _load(scaled)
    attn = folded.params["layers_0"]["self_attn"]
    assert not np.array_equal(attn["k_proj"]["kernel"], plain_params.params["layers_0"]["self_attn"]["k_proj"]["kernel"])
    for got, want in zip(_logprobs(folded, prompts), _logprobs(plain_params, prompts)):
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The tiny Llama as saved (K and V of ordinary size) and its params with a bf16 cache."""
    path = str(tmp_path_factory.mktemp("small"))
    make_hf_model("llama_gqa4", path)
    return path, _load(path, "auto").params


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_scale_layout_is_folded(small, layout, tmp_path):
    """Each layout's scales land where they should: Wq times k_scale, Wk over it, Wv over v_scale, Wo
    times it (one kv_scale stands for both)."""
    path, plain = small
    k_scales, v_scales = [0.37, 2.5], [1.9, 0.55]
    if layout == "kv_scale":
        v_scales = k_scales
    folded = _load(_rewrite(path, str(tmp_path), extra=_scale_tensors(layout, k_scales, v_scales))).params
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        got, want = folded[f"layers_{i}"]["self_attn"], plain[f"layers_{i}"]["self_attn"]
        for proj, factor in (("q_proj", k), ("k_proj", 1 / k), ("v_proj", 1 / v), ("o_proj", v)):
            np.testing.assert_allclose(got[proj]["kernel"], np.asarray(want[proj]["kernel"]) * factor, rtol=1e-6,
                                       err_msg=f"{layout} layer {i} {proj}")


def test_kv_only_compressed_tensors_checkpoint_loads(small, tmp_path):
    """llm-compressor's KV-cache-only model: a quantization_config with no weight groups, only a
    kv_cache_scheme; its weights load as floats and its scales fold."""
    path, plain = small
    config = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {},
                                      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                          "dynamic": False, "symmetric": True}}}
    scales = _scale_tensors("llm-compressor", [2.0, 2.0], [1.0, 1.0])
    folded = _load(_rewrite(path, str(tmp_path), extra=scales, config=config)).params
    np.testing.assert_allclose(folded["layers_1"]["self_attn"]["k_proj"]["kernel"],
                               np.asarray(plain["layers_1"]["self_attn"]["k_proj"]["kernel"]) / 2, rtol=1e-6)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_a_bad_scale_fails_the_load_naming_it(small, value, tmp_path, monkeypatch):
    """Refused before any weight is placed (the engine never comes to exist); an unused scale (no
    fp8 cache) is not read, so the same checkpoint loads with a bf16 cache."""
    path, _ = small
    bad = _rewrite(path, str(tmp_path), extra=_scale_tensors("llm-compressor", [1.0, value], [1.0, 1.0]))
    placed = []
    real = loader.assemble_params
    monkeypatch.setattr(loader, "assemble_params", lambda *a, **k: placed.append(1) or real(*a, **k))
    with pytest.raises(CheckpointError, match=re.escape("model.layers.1.self_attn.k_scale") + ".*finite and positive"):
        LLM(bad, kv_cache_dtype="fp8", max_num_seqs=2, max_model_len=64)
    assert not placed
    _load(bad, "auto")


def test_a_scale_of_the_wrong_shape_is_refused(small, tmp_path):
    path, _ = small
    bad = _rewrite(path, str(tmp_path), extra=_scale_tensors("llm-compressor", [np.ones(3), 1.0], [1.0, 1.0]))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_scale.*shape \(3,\)"):
        _load(bad)


def test_qwen3_folds_into_its_q_and_k_norms(tmp_path):
    """Qwen3 normalizes q and k per head after the projections: the norms take the K scale."""
    model = make_hf_model("qwen3", str(tmp_path / "base"))
    layers = model.config.num_hidden_layers
    scaled = _rewrite(str(tmp_path / "base"), str(tmp_path / "scaled"),
                      extra=_scale_tensors("llm-compressor", [0.3, 3.7][:layers], [2.2, 0.45][:layers]))
    plain, folded = _load(str(tmp_path / "base"), "auto"), _load(scaled)
    got, want = folded.params["layers_0"]["self_attn"], plain.params["layers_0"]["self_attn"]
    assert np.array_equal(got["q_proj"]["kernel"], want["q_proj"]["kernel"])
    np.testing.assert_allclose(got["k_norm"]["scale"], np.asarray(want["k_norm"]["scale"]) / 0.3, rtol=1e-6)
    prompts = _prompts(model.config.vocab_size, (24, 40))
    for a, b in zip(_logprobs(folded, prompts), _logprobs(plain, prompts)):
        np.testing.assert_allclose(a, b, atol=1e-4)


# format -> (the tensor of q_proj that takes its factor, the format the weights keep)
PREQUANTIZED = {"fp8-channel": ("weight_scale", "fp8"), "fp8-block": ("weight_scale_inv", "fp8"),
                "awq": ("scales", "int4")}


@pytest.mark.parametrize("fmt", sorted(PREQUANTIZED))
def test_checkpoint_saved_quantized_folds_into_its_scales(fmt, tmp_path):
    """FP8 / AWQ linears take the factor into their scale tensors; the weights stay in their format
    and compute what they did. AWQ's float16 group scales stay float16 (rounded once more)."""
    model = make_hf_model("llama_gqa4", str(tmp_path / "hf"))
    write_prequantized(model, str(tmp_path / "base"), fmt)
    scaled = _rewrite(str(tmp_path / "base"), str(tmp_path / "scaled"),
                      extra=_scale_tensors("autofp8", [0.3, 3.7], [2.2, 0.45]))
    plain, folded = _load(str(tmp_path / "base"), "auto"), _load(scaled)
    q = folded.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert q.format == PREQUANTIZED[fmt][1]
    prompts = _prompts(model.config.vocab_size, (24, 40))
    atol = 2e-3 if fmt == "awq" else 1e-4
    for a, b in zip(_logprobs(folded, prompts), _logprobs(plain, prompts)):
        np.testing.assert_allclose(a, b, atol=atol)

    per_head = _rewrite(str(tmp_path / "base"), str(tmp_path / "per_head"),
                        extra={"model.layers.0.self_attn.v_scale": np.array([0.5, 2.0])})
    with pytest.raises(UnsupportedModelError, match="v_proj: per-head KV cache scales on a linear saved quantized"):
        _load(per_head)


def test_tensor_parallel_loads_the_folded_weights(big_kv, tmp_path):
    """Sharded loading reads slices of the folded tensors (per-head factors sliced with them)."""
    plain, _, _, k_scales, v_scales = big_kv
    scaled = _rewrite(plain, str(tmp_path), extra=_scale_tensors(
        "llm-compressor", [s * np.array([0.7, 1.6]) for s in k_scales], [s * np.array([1.4, 0.9]) for s in v_scales]))
    one, two = _load(scaled), _load(scaled, tensor_parallel_size=2)
    assert two.plan is not None
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

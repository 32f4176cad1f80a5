"""`quantize_lm_head`: the untied LM head quantized with the projections, only when asked.

The model here is a tiny random Llama with an untied head whose vocab (257) does not split evenly
over 2 devices (padded to 258: 129 columns per device, across a 128-column quantization tile), and
whose head has larger weights so that its next-token distributions are peaked (the argmax means
something).
"""
import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax import quantization as quant
from atlasjax.bench.presets import PRESETS, load_preset
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError
from atlasjax.loader import _flatten, random_params
from atlasjax.model_source import quantizing_converter
from models.layers import is_quantized
from pallas_kernels.quant_format import dequantize
from tests.test_quantized_models import _full_logprobs

ENGINE = dict(max_num_seqs=4, max_model_len=96, page_size=16, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
VOCAB = 257


def _prompts(n=(24, 24, 24), seed=0):   # one length: the eager reference forward compiles once
    rs = np.random.RandomState(seed)
    return [[int(t) for t in rs.randint(0, VOCAB, size=k)] for k in n]


def _write_llama(out_dir, tied: bool) -> str:
    """A random 2-layer Llama checkpoint (HF names, safetensors, no tokenizer): 8 heads of 8, 2 KV heads."""
    from safetensors.numpy import save_file  # noqa: PLC0415
    hidden, inter, layers, heads, kv_heads, hd = 64, 128, 2, 8, 2, 8
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=hidden,
                  intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=tied, eos_token_id=0)
    rng = np.random.default_rng(0)

    def w(*shape, std=0.08):
        return rng.normal(0.0, std, shape).astype(np.float32)
    tensors = {"model.embed_tokens.weight": w(VOCAB, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    if not tied:
        tensors["lm_head.weight"] = w(VOCAB, hidden, std=0.8)   # peaked next-token distributions
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32)})
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return str(out_dir)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _write_llama(tmp_path_factory.mktemp("untied_lm_head"), tied=False)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The float32 model: its engine and full next-token log-probs at every prompt position."""
    llm = LLM(model_dir, **ENGINE)
    return llm, [_full_logprobs(llm.engine, p) for p in _prompts()]


@pytest.fixture(scope="module")
def int8_head(model_dir):
    return LLM(model_dir, quantization="int8", quantize_lm_head=True, **ENGINE)


def _head(llm):
    return llm.engine.runner.params["lm_head"]["kernel"]


def _mean_kl(ref, logprobs) -> float:
    return float(np.mean([np.sum(np.exp(r) * (r - q), axis=-1).mean() for r, q in zip(ref, logprobs)]))


# ---- what is quantized


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_lm_head_is_quantized_only_when_asked(fmt):
    cfg = PRESETS["tiny"]
    params = random_params(cfg, jnp.float32)
    default = quant.quantize_params(params, fmt)
    asked = quant.quantize_params(params, fmt, quantize_lm_head=True)
    assert not is_quantized(default["lm_head"]["kernel"])
    head = asked["lm_head"]["kernel"]
    assert is_quantized(head) and head.format == fmt and head.shape == (cfg.hidden_size, cfg.vocab_size)
    for tree in (default, asked):   # the embedding table never is; the projections always are
        assert not is_quantized(tree["embed_tokens"]["embedding"])
        assert is_quantized(tree["layers_0"]["mlp"]["down_proj"]["kernel"])
    # int4: K = hidden_size (64) is padded to whole groups of the default 128 (padding dequantizes to 0)
    w = np.asarray(params["lm_head"]["kernel"])
    err = np.abs(np.asarray(dequantize(head)) - w).max() / np.abs(w).max()
    assert err < {"int8": 0.01, "fp8": 0.07, "int4": 0.15}[fmt], err
    # the load-time converter makes the same choice
    head_path, emb_path = ("lm_head", "kernel"), ("embed_tokens", "embedding")
    assert quantizing_converter(fmt)(head_path, jnp.asarray(w)) is None
    assert is_quantized(quantizing_converter(fmt, quantize_lm_head=True)(head_path, jnp.asarray(w)))
    emb = params["embed_tokens"]["embedding"]
    assert quantizing_converter(fmt, quantize_lm_head=True)(emb_path, emb) is None


def test_quantize_lm_head_without_quantization_is_a_config_error():
    with pytest.raises(EngineConfigError, match="quantize_lm_head=True needs quantization"):
        EngineConfig(quantize_lm_head=True)
    with pytest.raises(EngineConfigError, match="quantize_lm_head must be True or False"):
        EngineConfig(quantization="int8", quantize_lm_head="yes")
    with pytest.raises(EngineConfigError, match="needs quantization"):
        load_preset("tiny", jnp.float32, None, quantize_lm_head=True)
    assert EngineConfig(quantization="int4", quantize_lm_head=True).quantize_lm_head


def test_tied_model_keeps_its_tied_head_and_says_so(tmp_path, monkeypatch, caplog):
    path = _write_llama(tmp_path, tied=True)
    monkeypatch.setattr(quant, "_warned_tied_lm_head", False)
    with caplog.at_level(logging.WARNING, logger="atlasjax.quantization"):
        llm = LLM(path, quantization="int8", quantize_lm_head=True, **ENGINE)   # no error
        assert quant.warn_if_tied_lm_head(dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True), True)
    assert not quant.warn_if_tied_lm_head(PRESETS["tiny"], True)   # untied: nothing to say
    warnings = [r for r in caplog.records if "no separate LM head" in r.getMessage()]
    assert len(warnings) == 1   # once per process
    params = llm.engine.runner.params
    assert "lm_head" not in params and not is_quantized(params["embed_tokens"]["embedding"])
    assert is_quantized(params["layers_0"]["mlp"]["down_proj"]["kernel"])


# ---- accuracy


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_quantized_head_stays_close_to_the_float_model(model_dir, reference, int8_head, fmt):
    """Next-token distributions at every prompt position, against the float32 model and against the
    same format with only the projections quantized: the head costs at most about what the
    projections do; int8 + head changes no clear next-token choice and keeps the float model's next
    tokens (fp8 and int4 are lossier, for the head as for the projections: docs/quantization.md)."""
    ref_llm, ref = reference
    projections = LLM(model_dir, quantization=fmt, **ENGINE)
    both = int8_head if fmt == "int8" else LLM(model_dir, quantization=fmt, quantize_lm_head=True, **ENGINE)
    head = _head(both)
    assert is_quantized(head) and head.format == fmt and not is_quantized(_head(projections))
    lp_proj = [_full_logprobs(projections.engine, p) for p in _prompts()]
    lp_both = [_full_logprobs(both.engine, p) for p in _prompts()]
    kl_proj, kl_both = _mean_kl(ref, lp_proj), _mean_kl(ref, lp_both)
    print(f"{fmt}: mean KL {kl_proj:.5f} (projections) -> {kl_both:.5f} (+ LM head) nats/token")
    assert kl_both <= 2 * kl_proj + 1e-3, (kl_proj, kl_both)
    if fmt != "int8":
        return
    assert kl_both < 0.01
    # The int8 head moves log-probs by ~0.04 nats (std) here: it flips no next token that the
    # projections-only model prefers by more than 0.25 nats (about 3/4 of the positions).
    for a, b in zip(lp_proj, lp_both):
        top2 = np.sort(a, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.25
        assert clear.mean() > 0.5 and (a.argmax(-1) == b.argmax(-1))[clear].all()
    agree = np.concatenate([r.argmax(-1) == b.argmax(-1) for r, b in zip(ref, lp_both)]).mean()
    assert agree >= 0.9, agree
    # The engine's compiled steps (f32 logits from the quantized head) pick the first tokens the
    # reference forward pass picks, which are the float engine's wherever that one is clear.
    first = [o.outputs[0].token_ids[0] for o in both.generate(_prompts(), GREEDY)]
    assert first == [int(b[-1].argmax()) for b in lp_both]
    ref_first = [o.outputs[0].token_ids[0] for o in ref_llm.generate(_prompts(), GREEDY)]
    for got, want, r in zip(first, ref_first, ref):
        top2 = np.sort(r[-1])[-2:]
        assert got == want or top2[1] - top2[0] < 0.25


# ---- tensor parallelism and checkpoints


def _same_params(a, b):
    fa, fb = dict(_flatten(a)), dict(_flatten(b))
    assert fa.keys() == fb.keys()
    for key, x in fa.items():
        y = fb[key]
        assert is_quantized(x) == is_quantized(y), key
        if is_quantized(x):
            assert (x.shape, x.format, x.group_size) == (y.shape, y.format, y.group_size), key
            x, y = dequantize(x), dequantize(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(key))


def _logprobs(out):
    return [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]


def test_tensor_parallel_splits_the_quantized_head_over_the_vocab(model_dir, int8_head):
    """TP=2 over a 257-token vocab: 129 columns per device (the last one zero), as one device computes."""
    prompts = _prompts((3, 11), seed=1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    tp = LLM(model_dir, quantization="int8", quantize_lm_head=True, tensor_parallel_size=2, **ENGINE)
    head = _head(tp)
    assert is_quantized(head) and head.qweight.shape[0] == 2 and head.shape == (64, 129)
    assert head.qweight.addressable_shards[0].data.shape[0] == 1   # each device holds its own half
    for a, b, prompt in zip(int8_head.generate(prompts, params), tp.generate(prompts, params), prompts):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(_logprobs(a), _logprobs(b), atol=1e-4)
        np.testing.assert_allclose([d[t].logprob for d, t in zip(a.prompt_logprobs[1:], prompt[1:])],
                                   [d[t].logprob for d, t in zip(b.prompt_logprobs[1:], prompt[1:])], atol=1e-4)
    # What LLM.save writes: the head joined back to its 257 columns, the vocab padding dropped.
    joined = tp.engine.runner.checkpoint_params()
    assert joined["lm_head"]["kernel"].shape == (64, VOCAB)
    _same_params(joined, int8_head.engine.runner.checkpoint_params())


def test_int4_head_splits_over_the_vocab_and_joins_back():
    """int4 (groups along K, offsets) split over the vocab as the loader places it, and gathered back.
    (A whole int4 model cannot run at TP=2 at these tiny sizes: its row-parallel projections would
    split K=64 inside 128-wide groups, a clear error of its own.)"""
    from atlasjax.sharding import TensorParallel, make_mesh  # noqa: PLC0415
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB)
    w = np.random.default_rng(1).normal(0, 1, (cfg.hidden_size, VOCAB)).astype(np.float32)
    qw = quant.quantize(w, "int4", symmetric=False)
    plan = TensorParallel(make_mesh(2), cfg)
    placed = plan.place_quantized(qw, ("embed", "vocab"))
    assert placed.shape == (64, 129) and placed.qweight.shape[0] == 2 and placed.zeros.shape[0] == 2
    halves = [np.asarray(dequantize(jax.tree.map(lambda leaf, d=d: leaf[d], placed))) for d in range(2)]
    whole = np.asarray(dequantize(qw))
    np.testing.assert_array_equal(np.concatenate(halves, axis=1), np.pad(whole, ((0, 0), (0, 1))))
    joined = plan.gather({"lm_head": {"kernel": placed}}, {"lm_head": {"kernel": ("embed", "vocab")}})
    back = joined["lm_head"]["kernel"]
    assert back.shape == (64, VOCAB) and back.zeros is not None
    np.testing.assert_array_equal(np.asarray(dequantize(back)), whole)


def test_saved_checkpoint_keeps_the_quantized_head(model_dir, tmp_path):
    llm = LLM(model_dir, quantization="int4", quantize_lm_head=True, **ENGINE)
    llm.save(str(tmp_path / "saved"))
    again = LLM(str(tmp_path / "saved"), **ENGINE)
    head = _head(again)
    assert is_quantized(head) and head.format == "int4" and head.zeros is not None
    # the same quantized values and scales, so the same outputs
    _same_params(again.engine.runner.checkpoint_params(), llm.engine.runner.checkpoint_params())


# ---- command lines


def test_cli_and_bench_flags_reach_the_engine():
    import argparse  # noqa: PLC0415

    from atlasjax.__main__ import add_engine_args, engine_kwargs  # noqa: PLC0415
    from atlasjax.bench.__main__ import build_parser  # noqa: PLC0415
    from atlasjax.bench.presets import build_engine  # noqa: PLC0415
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--quantization", "int8", "--quantize-lm-head"]))["quantize_lm_head"]
    assert not engine_kwargs(p.parse_args([]))["quantize_lm_head"]
    bench = ["latency", "--preset", "tiny", "--dtype", "float32", "--max-model-len", "64", "--num-pages", "8"]
    args = build_parser().parse_args([*bench, "--quantization", "int8", "--quantize-lm-head"])
    engine = build_engine(args)
    assert is_quantized(engine.runner.params["lm_head"]["kernel"])
    assert not is_quantized(build_engine(build_parser().parse_args([*bench, "--quantization", "int8"]))
                            .runner.params["lm_head"]["kernel"])
    with pytest.raises(EngineConfigError, match="needs quantization"):
        build_engine(build_parser().parse_args([*bench, "--quantize-lm-head"]))


def test_roofline_estimate_counts_the_quantized_head():
    from atlasjax.bench import roofline  # noqa: PLC0415
    cfg = PRESETS["llama-3.1-8b"]
    saved = roofline.estimate_weight_bytes(cfg, 2, "int8") - roofline.estimate_weight_bytes(cfg, 2, "int8", True)
    assert saved == pytest.approx(4096 * 128256 * (1 - 4 / 4096), rel=1e-3)   # ~0.52 GB: 2 bytes -> 1 (+ scales)
    tied = PRESETS["llama-3.2-1b"]
    assert roofline.estimate_weight_bytes(tied, 2, "int8", True) == roofline.estimate_weight_bytes(tied, 2, "int8")

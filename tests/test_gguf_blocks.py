"""GGUF block types kept quantized (atlasjax/gguf_blocks.py), against the `gguf` package's decoding."""

import gguf
import numpy as np
import pytest

from atlasjax.gguf_blocks import from_gguf_blocks, gguf_weight, is_block_type, kept_format
from atlasjax.quantization import dequantize
from atlasjax.weights_summary import weight_nbytes
from tests.gguf_kquant_encoders import encode_q4_k, encode_q6_k

Q = gguf.GGMLQuantizationType
# where each K-quant block keeps its fp16 super-block scales (d, and dmin where it has one)
_SCALE_BYTES = {Q.Q2_K: slice(-4, None), Q.Q3_K: slice(-2, None), Q.Q4_K: slice(0, 4), Q.Q5_K: slice(0, 4),
                Q.Q6_K: slice(-2, None)}


def _weight(n, k, seed=0):
    return (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)


def _random_blocks(qtype, n, k, seed=0):
    """Every bit pattern a K-quant block can hold: random bytes, with sane fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // block_size, type_size), np.uint8)
    where = _SCALE_BYTES[qtype]
    width = blocks[..., where].shape[-1]
    blocks[..., where] = rng.uniform(1e-4, 1e-2, blocks.shape[:2] + (width // 2,)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def _kept_vs_file(raw, qtype, n, k):
    qw = gguf_weight(raw, qtype, (n, k))
    assert qw.shape == (k, n) and qw.group_size == 32 and qw.format == kept_format(qtype)
    return qw, np.asarray(dequantize(qw)), gguf.quants.dequantize(raw, qtype).T   # [K, N] each


@pytest.mark.parametrize("encode,qtype,bound", [(encode_q4_k, Q.Q4_K, 0.1), (encode_q6_k, Q.Q6_K, 0.03)],
                         ids=["Q4_K", "Q6_K"])
def test_test_encoders_write_what_the_gguf_package_reads(encode, qtype, bound):
    # the K-quant files of the tests below are made by these encoders; a wrong layout would decode to noise
    w = _weight(64, 512)
    raw = encode(w)
    assert raw.shape == (64, 512 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
    got = gguf.quants.dequantize(raw, qtype)
    assert np.linalg.norm(got - w) / np.linalg.norm(w) < bound


@pytest.mark.parametrize("source", ["random bits", "encoded"])
@pytest.mark.parametrize("n", [96, 130])   # N under and over one 128-wide padding unit
def test_q4_k_is_kept_exactly_in_two_levels(source, n):
    k = 512
    raw = _random_blocks(Q.Q4_K, n, k, seed=n) if source == "random bits" else encode_q4_k(_weight(n, k, seed=n))
    qw, got, want = _kept_vs_file(raw, Q.Q4_K, n, k)
    assert qw.zeros is not None and not qw.zero_point and qw.mma_order   # float offsets, as Q4_1
    # the 6-bit sc and m as bytes, the file's d and -dmin as float16 per super-block of 256
    assert qw.two_level and qw.super_group == 256 and qw.scales.dtype == np.uint8 and qw.super_scales.dtype == np.float16
    np.testing.assert_array_equal(got, want)
    assert weight_nbytes(qw) * 8 == qw.padded_shape[0] * qw.padded_shape[1] * 4.625   # the file: 4.5 bits


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q2_K, Q.Q5_1])
def test_other_block_types_are_requantized_to_int8_groups_of_32(qtype):
    n, k = 96, 512
    raw = (gguf.quants.quantize(_weight(n, k), qtype) if qtype == Q.Q5_1 else _random_blocks(qtype, n, k))
    qw, got, want = _kept_vs_file(raw, qtype, n, k)
    assert qw.format == "int8" and qw.zeros is None
    # symmetric int8 per group of 32: off by at most half a step, 1/254 of the group's largest magnitude
    group_max = np.repeat(np.abs(want).reshape(k // 32, 32, n).max(axis=1), 32, axis=0)
    assert np.all(np.abs(got - want) <= group_max / 254 * (1 + 2e-3) + 1e-7)


def test_q5_0_is_kept_exactly_as_int8():
    w = _weight(96, 160)
    raw = gguf.quants.quantize(w, Q.Q5_0)
    qw, got, want = _kept_vs_file(raw, Q.Q5_0, 96, 160)
    np.testing.assert_array_equal(got, want)
    assert int(np.abs(np.asarray(qw.qweight, np.int32)).max()) <= 16   # 5-bit codes q - 16


def test_float_and_unknown_types_are_refused_with_their_names():
    assert not is_block_type(Q.F16) and not is_block_type("BF16") and is_block_type(Q.IQ4_NL)
    with pytest.raises(ValueError, match="F16 is not a quantized block type"):
        gguf_weight(np.zeros((4, 64), np.uint8), Q.F16, (4, 32))
    with pytest.raises(ValueError, match="Q6_K is not supported here"):
        from_gguf_blocks(np.zeros((1, 210), np.uint8), Q.Q6_K, (1, 256))
    with pytest.raises(ValueError, match="multiple of the Q4_K block size 256"):
        from_gguf_blocks(np.zeros((1, 144), np.uint8), "Q4_K", (1, 128))
    with pytest.raises(ValueError, match="unknown GGML type"):
        gguf_weight(np.zeros((1, 2), np.uint8), "Q9_9", (1, 32))


_SHAPES = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
           "self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
           "mlp.down_proj": (256, 512)}


def _write_k_quant_llama(path, head_type=Q.F32, patch=None, more_bits=True):
    """A 1-layer untied Llama GGUF, Q4_K_M-like: v and down in Q6_K, the other projections in Q4_K,
    the LM head (output.weight) in `head_type`; a 256-byte vocabulary. patch: GGUF name -> a function
    of that tensor's encoded blocks (to write bad ones). more_bits=False: v and down in Q4_K too."""
    import transformers

    from tests.gguf_writer_util import write_gguf_from_hf
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      tie_word_embeddings=False)
    rng = np.random.default_rng(0)
    state = {f"model.layers.0.{p}.weight": rng.standard_normal(s).astype(np.float32) * 0.05 for p, s in _SHAPES.items()}
    state |= {"model.layers.0.input_layernorm.weight": np.ones(256, np.float32),
              "model.layers.0.post_attention_layernorm.weight": np.ones(256, np.float32),
              "model.norm.weight": np.ones(256, np.float32),
              "model.embed_tokens.weight": rng.standard_normal((256, 256)).astype(np.float32),
              "lm_head.weight": rng.standard_normal((256, 256)).astype(np.float32) * 0.3}

    def encode(name, array):
        if array.ndim == 1 or name == "token_embd.weight":
            return array, Q.F32
        if name == "output.weight":   # gguf cannot encode K-quants: Q6_K through the test encoder
            encoders = {Q.F32: lambda a: a, Q.Q6_K: encode_q6_k}
            return encoders.get(head_type, lambda a: gguf.quants.quantize(a, head_type))(array), head_type
        if more_bits and name.endswith(("attn_v.weight", "ffn_down.weight")):
            return encode_q6_k(array), Q.Q6_K
        return (patch or {}).get(name, lambda raw: raw)(encode_q4_k(array)), Q.Q4_K

    write_gguf_from_hf(state, config, path, encode=encode)
    return str(path)


def test_llama_k_quant_file_loads_kept_with_the_q_k_rows_unpermuted(tmp_path):
    # llama.cpp permutes q/k rows per head in llama files; kept blocks must be reordered like the floats
    import jax.numpy as jnp

    from atlasjax.loader import load_model
    path = _write_k_quant_llama(tmp_path / "k.gguf")
    kept = load_model(path, jnp.float32, keep_gguf_quantized=True).params
    floats = load_model(path, jnp.float32, keep_gguf_quantized=False).params
    for path, want in _SHAPES.items():
        module, proj = path.split(".")
        qw = kept["layers_0"][module][proj]["kernel"]
        assert qw.format == ("int8" if proj in ("v_proj", "down_proj") else "int4"), proj
        got, ref = np.asarray(dequantize(qw)), np.asarray(floats["layers_0"][module][proj]["kernel"])
        assert got.shape == ref.shape == want[::-1]
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2, proj   # a wrong row order is ~1.4


@pytest.mark.parametrize("head_type", [Q.Q6_K, Q.Q8_0], ids=["Q6_K", "Q8_0"])
def test_untied_lm_head_stays_quantized(tmp_path, head_type):
    # output.weight in a block type runs quantized, as llama.cpp runs it (Q6_K is what Q4_K_M files
    # store; an 8B head in bf16 would be 1.05 GB read per token). Q8_0 is kept exactly, Q6_K as int8
    # within half a step; the model's next-token distributions stay those of the file read as floats.
    from atlasjax import LLM
    from models.layers import is_quantized
    from tests.test_quantized_models import Q4_K_M_KL_BOUND, _full_logprobs
    path = _write_k_quant_llama(tmp_path / "h.gguf", head_type)
    kept = LLM(path, max_num_seqs=2, max_model_len=64, keep_gguf_quantized=True, dtype="float32")
    floats = LLM(path, max_num_seqs=2, max_model_len=64, keep_gguf_quantized=False, dtype="float32")
    head, ref = kept.engine.runner.params["lm_head"]["kernel"], floats.engine.runner.params["lm_head"]["kernel"]
    assert is_quantized(head) and not is_quantized(ref)
    assert head.format == "int8" and head.group_size == 32 and head.shape == (256, 256)
    err = np.linalg.norm(np.asarray(dequantize(head)) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
    assert err < (1e-7 if head_type == Q.Q8_0 else 1e-2), err
    ids = list(range(3, 40))
    got, want = _full_logprobs(kept.engine, ids), _full_logprobs(floats.engine, ids)
    kl = float(np.sum(np.exp(want) * (want - got), axis=-1).mean())
    assert kl < Q4_K_M_KL_BOUND, kl   # Q6_K measured 2e-4 nats/token here; the projections alone 3e-5
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def test_a_q4_k_scale_beyond_float16_stays_kept_and_exact(tmp_path):
    # A sub-block scale d * sc beyond float16's range (d = 2048, sc = 63) is held in two levels as
    # the file holds it: the tensor stays quantized and computes the file's values exactly.
    import jax.numpy as jnp

    from atlasjax.loader import load_model
    from models.layers import is_quantized

    def oversize(raw):   # the first sub-block of the first row: d = 2048, sc = 63
        blocks = raw.reshape(raw.shape[0], -1, 144)
        blocks[0, 0, 0:2] = np.array([2048], np.float16).view(np.uint8)
        blocks[0, 0, 4] = (blocks[0, 0, 4] & 0xC0) | 63
        return blocks.reshape(raw.shape)

    path = _write_k_quant_llama(tmp_path / "big.gguf", patch={"blk.0.attn_output.weight": oversize})
    kept = load_model(path, jnp.float32, keep_gguf_quantized=True).params["layers_0"]["self_attn"]
    floats = load_model(path, jnp.float32, keep_gguf_quantized=False).params["layers_0"]["self_attn"]
    assert is_quantized(kept["o_proj"]["kernel"])
    np.testing.assert_array_equal(np.asarray(dequantize(kept["o_proj"]["kernel"])), np.asarray(floats["o_proj"]["kernel"]))
    assert np.abs(np.asarray(floats["o_proj"]["kernel"])).max() > 65504   # the file's value, kept


def test_a_tensor_the_kept_format_cannot_hold_falls_back_to_floats(tmp_path, caplog, monkeypatch):
    # Blocks that `gguf_weight` refuses (a ValueError) load as floats, with a warning naming the
    # tensor; the rest stay kept.
    import logging

    import jax.numpy as jnp

    import atlasjax.gguf_blocks as blocks
    from atlasjax.loader import load_model
    from models.layers import is_quantized

    path = _write_k_quant_llama(tmp_path / "model.gguf")
    floats = load_model(path, jnp.float32, keep_gguf_quantized=False).params["layers_0"]["self_attn"]
    keep = blocks.gguf_weight

    def refuse_o_proj(raw, qtype, shape_hf):
        if shape_hf == (256, 256) and np.array_equal(raw, refuse_o_proj.raw):
            raise ValueError("blocks this test cannot keep")
        return keep(raw, qtype, shape_hf)
    reader = gguf.GGUFReader(path)
    refuse_o_proj.raw = next(np.asarray(t.data) for t in reader.tensors if t.name == "blk.0.attn_output.weight")
    monkeypatch.setattr(blocks, "gguf_weight", refuse_o_proj)
    with caplog.at_level(logging.WARNING, logger="atlasjax.loader"):
        kept = load_model(path, jnp.float32, keep_gguf_quantized=True).params["layers_0"]["self_attn"]
    assert any("self_attn.o_proj.weight" in r.getMessage() and "floats" in r.getMessage() for r in caplog.records)
    assert not is_quantized(kept["o_proj"]["kernel"]) and is_quantized(kept["q_proj"]["kernel"])
    np.testing.assert_array_equal(np.asarray(kept["o_proj"]["kernel"]), np.asarray(floats["o_proj"]["kernel"]))

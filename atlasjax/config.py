"""Model configuration: one frozen, validated `ModelConfig` and its converter from HF config.json.

`from_hf_config` is the single place that reads Hugging Face (and GGUF-derived) config dicts;
everything downstream sees only `ModelConfig`, which is hashable and passes into jitted
functions as a static argument.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from atlasjax.errors import UnsupportedModelError

# model_type / architectures name -> family implemented in models/
_FAMILIES = {
    "llama": "llama", "mistral": "llama", "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
    "qwen2": "qwen2", "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3", "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM (llama, Mistral, SmolLM2)", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`)."""
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (HF's names): the ramp between interpolated and kept frequencies, and the cos/sin scale
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None   # None: from factor (and mscale / mscale_all_dim), as HF
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in _ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {self.rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
        if self.factor <= 0:
            raise UnsupportedModelError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, as the model code needs it."""
    family: str                      # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False           # qwen2
    qk_norm: bool = False            # qwen3
    sliding_window: int | None = None   # Mistral v0.1's window; we attend to the whole context, so it caps it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.family not in ("llama", "qwen2", "qwen3"):
            raise UnsupportedModelError(f"model family {self.family!r} is not supported")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def max_positions(self) -> int:
        """The longest context the model is made for (vLLM's derived max_model_len): its position table,
        stretched by a linear or yarn RoPE scaling, and no longer than a sliding window we do not apply."""
        rs = self.rope_scaling
        longest = self.max_position_embeddings
        if rs.rope_type == "yarn":
            longest = int(rs.original_max_position_embeddings * rs.factor)
        elif rs.rope_type == "linear":
            longest = int(longest * rs.factor)
        return min(longest, self.sliding_window or longest)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * d * f + 2 * d
        return self.num_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters` (theta inside); published checkpoints use rope_theta/rope_scaling.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, RopeScaling()
    positions = int(hf.get("max_position_embeddings", 4096))
    original = int(merged.get("original_max_position_embeddings") or positions)   # HF's default
    factor = merged.get("factor")
    if factor is None and rope_type == "yarn":   # as HF: the stretch from the original length
        factor = positions / original

    def number(name, default=None):
        value = merged.get(name)
        return default if value is None else float(value)

    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=number("low_freq_factor", 1.0),
        high_freq_factor=number("high_freq_factor", 4.0),
        original_max_position_embeddings=original,
        beta_fast=number("beta_fast", 32.0) or 32.0,   # HF reads 0 as unset too
        beta_slow=number("beta_slow", 1.0) or 1.0,
        attention_factor=number("attention_factor"),
        mscale=number("mscale"),
        mscale_all_dim=number("mscale_all_dim"),
        truncate=bool(merged.get("truncate", True)),
    )


def sliding_window_from_hf(hf: dict[str, Any]) -> int | None:
    """The attention window a config asks for, if it is in effect (Qwen2/3 name one with use_sliding_window off)."""
    window = hf.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or hf.get("use_sliding_window") is False:
        return None
    return window


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Convert a Hugging Face config.json dict (or a GGUF-derived one) to a ModelConfig."""
    names = list(hf.get("architectures") or []) + [hf.get("model_type", "")]
    family = next((_FAMILIES[n] for n in names if n in _FAMILIES), None)
    if family is None:
        got = ", ".join(str(n) for n in names if n) or "unknown"
        raise UnsupportedModelError(
            f"unsupported model architecture: {got}. Supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = rope_from_hf(hf)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    head_dim = hf.get("head_dim") or hidden // num_heads
    return ModelConfig(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if family != "llama" else 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=sliding_window_from_hf(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_hf_config(model_dir: str | os.PathLike) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        return from_hf_config(json.load(f))

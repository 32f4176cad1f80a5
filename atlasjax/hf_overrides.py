"""vLLM's `hf_overrides` (`--hf-overrides JSON`): config.json keys set over the model's own.

Two kinds are taken:
- keys that change how positions are read, not any weight's shape (`MODEL_KEYS`): `rope_scaling` /
  `rope_parameters` (e.g. yarn, to run Qwen3 past 32k tokens), `rope_theta`, `max_position_embeddings`,
  `sliding_window` / `use_sliding_window`. They apply to any checkpoint (HF directory, GGUF, saved) once it
  has loaded (`with_model_overrides`);
- the keys that read a causal LM as a classifier / reranker (atlasjax/cross_encoder.py).
Anything else is refused by name.
"""
from __future__ import annotations

import dataclasses

from atlasjax import cross_encoder
from atlasjax.config import ModelConfig, rope_from_hf, sliding_window_from_hf
from atlasjax.config_json import json_dict
from atlasjax.errors import EngineConfigError, UnsupportedModelError

MODEL_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings", "sliding_window",
              "use_sliding_window")


def parse_hf_overrides(value) -> dict | None:
    """None, a dict or its JSON, checked (EngineConfigError naming what is wrong)."""
    if value is None:
        return None
    value = json_dict(value, "hf_overrides")
    unknown = sorted(set(value) - set(MODEL_KEYS) - set(cross_encoder.KNOWN_KEYS))
    if unknown:
        raise EngineConfigError(
            f"hf_overrides: {unknown} not supported (supported: {list(MODEL_KEYS)}: the model's RoPE and "
            f"positions; {list(cross_encoder.KNOWN_KEYS)}: a causal LM read as a classifier or reranker)")
    _check_model_keys(value)
    if cross_encoder.is_classifier(value):
        cross_encoder.check_overrides(value)
    return value


def _check_model_keys(value: dict) -> None:
    for name in ("rope_scaling", "rope_parameters"):
        if name in value and not isinstance(value[name], dict | None):
            raise EngineConfigError(f"hf_overrides: {name} must be a JSON object, got {value[name]!r}")
    for name, kind in (("rope_theta", int | float), ("max_position_embeddings", int), ("sliding_window", int)):
        number = value.get(name)
        if number is not None and (isinstance(number, bool) or not isinstance(number, kind) or number <= 0):
            what = "number" if name == "rope_theta" else "whole number"
            raise EngineConfigError(f"hf_overrides: {name} must be a positive {what}, got {number!r}")
    if "use_sliding_window" in value and not isinstance(value["use_sliding_window"], bool):
        raise EngineConfigError(f"hf_overrides: use_sliding_window must be true or false, got "
                                f"{value['use_sliding_window']!r}")
    if any(k in value for k in ("rope_scaling", "rope_parameters", "rope_theta")):
        try:   # an unknown RoPE type or a bad factor, before any model loads
            rope_from_hf({"max_position_embeddings": value.get("max_position_embeddings", 4096), **value})
        except (UnsupportedModelError, TypeError, ValueError) as e:
            raise EngineConfigError(f"hf_overrides: {e}") from None


def with_model_overrides(cfg: ModelConfig, overrides: dict | None) -> ModelConfig:
    """cfg with the MODEL_KEYS of `overrides` applied (a new RoPE scaling replaces the model's whole)."""
    keys = {k: overrides[k] for k in MODEL_KEYS if k in (overrides or {})}
    if not keys:
        return cfg
    hf = {"max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
          "sliding_window": cfg.sliding_window}
    if cfg.rope_scaling.rope_type != "default" and not ("rope_scaling" in keys or "rope_parameters" in keys):
        hf["rope_scaling"] = dataclasses.asdict(cfg.rope_scaling)
    hf.update(keys)
    theta, scaling = rope_from_hf(hf)
    return dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling,
                               max_position_embeddings=int(hf["max_position_embeddings"]),
                               sliding_window=sliding_window_from_hf(hf))

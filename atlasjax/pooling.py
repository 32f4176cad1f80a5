"""Embeddings from a decoder model's final hidden states: how a model pools them, what a request may ask.

A model directory saved by sentence-transformers says how to pool: `modules.json` lists the modules
(Transformer, Pooling, maybe Normalize), and `1_Pooling/config.json` names the pooling mode. Without those
files the engine pools the last token and normalizes (vLLM's default for decoder models: Qwen3-Embedding,
e5-mistral, gte-Qwen2). `EngineConfig.pooling_type` overrides the mode.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from atlasjax.errors import InvalidRequestError, UnsupportedModelError
from atlasjax.sampling_params import check_truncate_prompt_tokens

POOLING_TYPES = ("last", "mean", "cls", "max")
TASKS = ("embed", "classify")
# sentence-transformers' Pooling flags -> our pooling type
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max"}
_ST_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULES = {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
               "sentence_transformers.models.Normalize"}


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """Per request (vLLM's PoolingParams). dimensions: keep the first N values (Matryoshka models), before
    normalizing; normalize: None follows the model (its Normalize module, else True); truncate_prompt_tokens:
    embed only the last N tokens of a longer input (-1: the last max_model_len)."""
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"      # embed | classify: the classification head's logits over the last token's state

    def __post_init__(self):
        if self.task not in TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be a boolean, got {self.normalize!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How the loaded model turns hidden states into one embedding. unsupported: why this model's
    sentence-transformers pipeline cannot be reproduced (a Dense layer, an unknown pooling mode); embedding
    requests are refused with it, generation is not affected."""
    pooling_type: str | None = "last"   # None: the model's mode is not one the engine runs (unsupported says which)
    normalize: bool = True
    source: str = "default"
    unsupported: str | None = None

    def describe(self) -> str:
        return f"{self.pooling_type} pooling, {'normalized' if self.normalize else 'not normalized'} ({self.source})"


def read_pooler_config(model: str | None, pooling_type: str | None = None) -> PoolerConfig:
    """The pooler of the model at `model` (a directory with sentence-transformers files, or anything else:
    the default), with `pooling_type` (EngineConfig's) over the model's mode."""
    config = _sentence_transformers_config(model) if model and os.path.isdir(model) else PoolerConfig()
    if pooling_type is not None:
        if pooling_type not in POOLING_TYPES:
            raise UnsupportedModelError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}")
        config = dataclasses.replace(config, pooling_type=pooling_type, source=f"{config.source}, pooling_type set",
                                     unsupported=None if config.pooling_type is None else config.unsupported)
    return config


def _sentence_transformers_config(model_dir: str) -> PoolerConfig:
    path = os.path.join(model_dir, "modules.json")
    if not os.path.exists(path):
        return PoolerConfig()
    try:
        with open(path) as f:
            modules = json.load(f)
        pooling = next((m for m in modules if m.get("type") == "sentence_transformers.models.Pooling"), None)
        pool_cfg = {}
        if pooling is not None:
            with open(os.path.join(model_dir, pooling.get("path", ""), "config.json")) as f:
                pool_cfg = json.load(f)
    except (OSError, ValueError, AttributeError) as e:
        return PoolerConfig(source="modules.json", unsupported=f"cannot read the sentence-transformers config: {e}")
    normalize = any(m.get("type") == "sentence_transformers.models.Normalize" for m in modules)
    source = "sentence-transformers modules.json"
    other = sorted({m.get("type", "?") for m in modules} - _ST_MODULES)
    if other:
        return PoolerConfig(normalize=normalize, source=source,
                            unsupported=f"the model's sentence-transformers pipeline has modules the engine does "
                                        f"not run: {', '.join(other)}")
    modes = [mode for flag, mode in _ST_MODES.items() if pool_cfg.get(flag)]
    odd = [flag for flag in _ST_UNSUPPORTED if pool_cfg.get(flag)]
    if odd or len(modes) > 1 or pool_cfg.get("include_prompt") is False:
        what = ", ".join(odd + [f for f in _ST_MODES if pool_cfg.get(f)] * (len(modes) > 1)) or "include_prompt=false"
        return PoolerConfig(pooling_type=None, normalize=normalize, source=source,
                            unsupported=f"unsupported pooling mode ({what}); set pooling_type to one of "
                                        f"{', '.join(POOLING_TYPES)}")
    return PoolerConfig(pooling_type=modes[0] if modes else "last", normalize=normalize, source=source)


def pool_ragged(hidden, seq_ids, query_start, seq_lens, pooling_type: str):
    """hidden [T, E] of inputs packed end to end (input s owns rows query_start[s]:query_start[s + 1];
    seq_ids[t] = s, padding rows = the count of inputs) -> [inputs, E] float32 (traced inside jit)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    num, last_row = seq_lens.shape[0], hidden.shape[0] - 1
    hidden = hidden.astype(jnp.float32)
    if pooling_type == "last":
        return hidden[jnp.clip(query_start[1:] - 1, 0, last_row)]
    if pooling_type == "cls":
        return hidden[jnp.clip(query_start[:-1], 0, last_row)]
    if pooling_type == "mean":
        sums = jax.ops.segment_sum(hidden, seq_ids, num_segments=num + 1)[:num]
        return sums / jnp.maximum(seq_lens, 1)[:, None].astype(jnp.float32)
    if pooling_type == "max":
        return jax.ops.segment_max(hidden, seq_ids, num_segments=num + 1)[:num]
    raise ValueError(f"unknown pooling type {pooling_type!r}")


@dataclasses.dataclass(frozen=True)
class ClassifierHead:
    """A sequence-classification checkpoint's `score` layer (`*ForSequenceClassification`: reward models,
    classifiers): logits = weight @ the last token's final hidden state."""
    weight: np.ndarray                 # [num_labels, hidden] float32
    labels: tuple[str, ...]            # config.json's id2label, in order

    def logits(self, vector: np.ndarray) -> np.ndarray:
        return (self.weight @ vector.astype(np.float32)).astype(np.float32)


def class_probs(logits: np.ndarray) -> np.ndarray:
    """vLLM's classification output: softmax over the labels, a sigmoid for a single-label head."""
    logits = np.asarray(logits, np.float64)
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def finish(vector: np.ndarray, params: PoolingParams, config: PoolerConfig,
           classifier: ClassifierHead | None = None) -> np.ndarray:
    """One pooled vector as the request asked: its first `dimensions` values, then L2-normalized (or not);
    for task="classify", the classification head's logits."""
    if params.task == "classify":
        return classifier.logits(vector)
    if params.dimensions is not None:
        if params.dimensions > vector.shape[-1]:
            raise InvalidRequestError(f"dimensions={params.dimensions} exceeds the model's embedding size "
                                      f"{vector.shape[-1]}")
        vector = vector[:params.dimensions]
    if config.normalize if params.normalize is None else params.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)

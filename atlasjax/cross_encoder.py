"""Cross-encoder scoring: a causal LM read as a sequence classifier through vLLM's `hf_overrides`, so `LLM.score`,
`/score` and `/rerank` run a reranker such as Qwen3-Reranker over each (query, document) pair.

Qwen3-Reranker is a Qwen3ForCausalLM that answers "yes" or "no"; its relevance score is
softmax([logit("no"), logit("yes")])[1] at the last position = sigmoid(h . (W_yes - W_no)). vLLM serves it with
`--hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": true}'`, which this module reproduces: `classifier_from_token` picks LM-head rows
as a classification head (two tokens with `is_original_qwen3_reranker` or `"method": "from_2_way_softmax"`: one
label, their difference). A model whose head has one label is a cross-encoder: a pair's score is the sigmoid
of the head over the pair's tokens, the first text's then the second's (`pair_ids`), as vLLM joins them for a
decoder model. The prompt format (Qwen3-Reranker's instruction template) is the caller's, as in vLLM's examples.
"""
from __future__ import annotations

import numpy as np

from atlasjax.errors import EngineConfigError
from atlasjax.pooling import ClassifierHead, class_probs

KNOWN_KEYS = ("architectures", "classifier_from_token", "method", "is_original_qwen3_reranker")


def is_classifier(overrides: dict | None) -> bool:
    """Whether vLLM's hf_overrides read the model as a classifier / reranker (any key of this module's)."""
    return bool(overrides) and any(k in overrides for k in KNOWN_KEYS)


def check_overrides(value: dict) -> None:
    """The cross-encoder keys of hf_overrides (atlasjax/hf_overrides.py), checked."""
    tokens = value.get("classifier_from_token")
    if tokens is None:
        raise EngineConfigError("hf_overrides needs classifier_from_token (the tokens whose LM-head rows make the "
                                "classification head)")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise EngineConfigError("hf_overrides: classifier_from_token must be a non-empty list of token strings")
    archs = value.get("architectures", ["ForSequenceClassification"])
    if not isinstance(archs, list) or not all(isinstance(a, str) and a.endswith("ForSequenceClassification")
                                              for a in archs):
        raise EngineConfigError(f"hf_overrides: architectures must name a *ForSequenceClassification class, got "
                                f"{archs!r}")
    if value.get("method", "from_2_way_softmax" if two_way(value) else None) not in (None, "from_2_way_softmax"):
        raise EngineConfigError(f"hf_overrides: method {value['method']!r} is not supported (from_2_way_softmax)")
    if two_way(value) and len(tokens) != 2:
        raise EngineConfigError("hf_overrides: a 2-way softmax head takes exactly two tokens (the negative, then "
                                f"the positive), got {tokens}")


def two_way(overrides: dict) -> bool:
    return bool(overrides.get("is_original_qwen3_reranker")) or overrides.get("method") == "from_2_way_softmax"


def head_from_tokens(params: dict, tie_word_embeddings: bool, tokenizer, overrides: dict):
    """The classification head `overrides` describes, from the LM head's rows (the embedding table's when tied),
    as a ClassifierHead (float32, host): one label per token, or one label (positive minus negative)."""
    if tokenizer is None:
        raise EngineConfigError("hf_overrides: classifier_from_token needs the model's tokenizer")
    tokens = overrides["classifier_from_token"]
    ids = []
    for t in tokens:
        found = tokenizer.encode(t, add_special_tokens=False)
        if len(found) != 1:
            raise EngineConfigError(f"hf_overrides: classifier_from_token {t!r} is {len(found)} tokens for this "
                                    "tokenizer; each must be exactly one")
        ids.append(found[0])
    if tie_word_embeddings:
        table = params["embed_tokens"]["embedding"]
        rows = np.asarray(table[np.asarray(ids)], np.float32)                   # [n, hidden]
    else:
        import jax  # noqa: PLC0415
        kernel = params["lm_head"]["kernel"]
        if not isinstance(kernel, (np.ndarray, jax.Array)):
            raise EngineConfigError("hf_overrides: the LM head is stored quantized; a classifier from its rows "
                                    "needs it unquantized (leave quantize_lm_head off)")
        rows = np.asarray(kernel[:, np.asarray(ids)], np.float32).T            # [n, hidden]
    if two_way(overrides):
        return ClassifierHead(rows[1:2] - rows[0:1], ("score",))
    return ClassifierHead(rows, tuple(tokens))


def pair_ids(first: list[int], second: list[int]) -> list[int]:
    """A (query, document) pair's tokens, as one sequence."""
    return list(first) + list(second)


def pair_score(logits: np.ndarray) -> float:
    """A pair's score from a one-label head's logit: its sigmoid (vLLM's)."""
    return float(class_probs(logits)[0])


def is_cross_encoder(labels: tuple[str, ...]) -> bool:
    """A classification head of one label scores pairs (vLLM's rule for *ForSequenceClassification models)."""
    return len(labels) == 1

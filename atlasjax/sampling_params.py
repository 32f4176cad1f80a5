"""SamplingParams: per-request generation settings, validated on construction (vLLM-compatible names)."""
from __future__ import annotations

import dataclasses
import operator

from atlasjax.errors import InvalidRequestError

MAX_LOGPROBS = 20          # top-k logprobs computed on device (static shape)
MAX_STOP_TOKEN_IDS = 16    # per-request stop ids masked on device while min_tokens is not reached
MAX_LOGIT_BIAS = 300       # logit_bias entries per request (OpenAI's limit; kept per slot on device)
MAX_BAD_WORDS = 16         # bad_words per request (their token sequences: atlasjax/bad_words.py)


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16      # None: up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None      # top-k logprobs per generated token (the chosen one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True          # False: token ids only (no text, no stop strings), as vLLM's
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling, in [-100, 100]
    allowed_token_ids: list[int] | None = None   # sample only among these tokens (at most MAX_LOGIT_BIAS)
    truncate_prompt_tokens: int | None = None    # keep the prompt's last k tokens; -1: as many as fit (see below)
    bad_words: list[str] | None = None           # words never generated (atlasjax/bad_words.py)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.logit_bias = parse_logit_bias(self.logit_bias)
        self.allowed_token_ids = parse_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = parse_bad_words(self.bad_words)

    def _validate(self):
        def bad(msg):
            raise InvalidRequestError(msg)
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not self.detokenize and self.stop:
            bad("stop strings need detokenize=True (without text there is nothing to match them in)")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens < 2**31):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens < 2**31 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                bad(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def truncated_prompt(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt the request runs on: with `truncate_prompt_tokens` k, its last k tokens (vLLM's left
        truncation); k = -1 keeps as many as the context holds beside max_tokens (one token if unset)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        if k == -1:
            k = max(1, max_model_len - (self.max_tokens or 1))
        return token_ids[-k:]

    def bias_table(self) -> dict[int, float] | None:
        """The per-slot token table the device samples with: the logit_bias entries or, with
        allowed_token_ids, exactly the allowed ids (each with its bias, else 0), the only tokens it may pick."""
        if self.allowed_token_ids is None:
            return self.logit_bias
        bias = self.logit_bias or {}
        return {t: bias.get(t, 0.0) for t in self.allowed_token_ids}


def parse_bad_words(words) -> list[str] | None:
    if words is None:
        return None
    if isinstance(words, str) or not isinstance(words, list | tuple) or not all(isinstance(w, str) and w.strip()
                                                                                for w in words):
        raise InvalidRequestError("bad_words must be a list of non-empty strings")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequestError(f"bad_words has {len(words)} entries; at most {MAX_BAD_WORDS} are supported")
    return list(words) or None


def check_truncate_prompt_tokens(k) -> int | None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or 1 <= k < 2**31)):
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {k!r}")
    return k


def parse_allowed_token_ids(ids) -> list[int] | None:
    """allowed_token_ids as distinct int ids, in order, validated; None if not given."""
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not ids:
        raise InvalidRequestError("allowed_token_ids must be a non-empty list of token ids")
    try:
        if any(isinstance(t, bool) for t in ids):
            raise TypeError
        out = list(dict.fromkeys(operator.index(t) for t in ids))    # (numpy integers too; no floats)
    except TypeError:
        raise InvalidRequestError("allowed_token_ids must be a list of integer token ids") from None
    if not all(0 <= t < 2**31 for t in out):
        raise InvalidRequestError("allowed_token_ids must be non-negative token ids")
    if len(out) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"at most {MAX_LOGIT_BIAS} allowed_token_ids are supported, got {len(out)}")
    return out


def parse_logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias} with int ids (JSON keys arrive as strings) and float biases, validated; None if empty."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}") from None
        if isinstance(key, (bool, float)) or not 0 <= token < 2**31:
            raise InvalidRequestError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            raise InvalidRequestError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key!r}")
        out[token] = out.get(token, 0.0) + float(value)
    return out

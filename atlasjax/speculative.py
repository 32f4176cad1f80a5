"""Speculative decoding, as vLLM's `speculative_config`: n-gram (prompt lookup) drafts (`method: "ngram"`), a
smaller draft model's (`method: "draft_model"`, atlasjax/draft_model.py) or an EAGLE-3 head's (`method: "eagle3"`,
atlasjax/eagle3.py).

Plain Python and numpy, no jax. Each decode-only step, every running request proposes up to
`num_speculative_tokens` draft tokens. n-gram: the tokens that followed the latest earlier occurrence of its last
n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in its own prompt and output, found on the host,
or, in launches of several verify rounds, by the same rule on the device (atlasjax/ngram_lookup.py).
Draft model or EAGLE-3 head: its greedy tokens, proposed on the device inside the verify step. The engine
then runs one verify step (atlasjax/steps.py `verify_step`) over each request's last token and its drafts,
samples a token at every position from the target model's own distribution, as a decode step would, and
keeps the drafts up to the first that differs from the token sampled before it, plus that sampled token.

Why that is exact, for sampling as for greedy: a draft d is a point mass, so the standard rejection rule
accepts it with probability p(d) and otherwise samples from p with d removed; drawing x ~ p and accepting
d when x == d does the same. Each position draws with the seed stream of its output index, so a seeded
request yields the same tokens with and without speculation.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from atlasjax.config_json import json_dict
from atlasjax.errors import EngineConfigError


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 4     # drafts per request and step (k): a step emits up to k + 1 tokens
    prompt_lookup_max: int | None = None   # longest suffix n-gram looked up } vLLM's defaults: both 5, or
    prompt_lookup_min: int | None = None   # shortest                         } the one given for both
    disable_by_batch_size: int | None = None   # no drafts in a step of this many running requests or more
                                               # (where the batch already fills the device)
    method: str | None = None   # "ngram" (default without `model`), "draft_model" (default with it) or "eagle3"
    model: str | None = None    # the draft model or EAGLE-3 head: a local path or Hub id, as the engine's model
    draft_tensor_parallel_size: int | None = None   # None or the engine's tensor_parallel_size: the draft is split
                                                    # over the target's devices (EngineConfig checks it)
    quantization: str | None = None   # the draft's weights: only None (they run in the engine's dtype)
    revision: str | None = None       # accepted as vLLM's; only None (no hub downloads)

    def __post_init__(self):
        def bad(msg):
            raise EngineConfigError(f"speculative_config: {msg}")
        method = self.method or ("draft_model" if self.model is not None else "ngram")
        object.__setattr__(self, "method", "ngram" if method == "prompt_lookup" else method)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        object.__setattr__(self, "prompt_lookup_min", lo if lo is not None else hi if hi is not None else 5)
        object.__setattr__(self, "prompt_lookup_max", hi if hi is not None else self.prompt_lookup_min)
        if self.method not in ("ngram", "draft_model", "eagle3"):
            bad(f"method {self.method!r} is not supported (supported: 'ngram', drafts looked up in the request's own "
                "tokens, 'draft_model', a smaller model's, and 'eagle3', an EAGLE-3 head's; EAGLE-1, Medusa and MTP "
                "are not implemented)")
        if self.method in ("draft_model", "eagle3"):
            if not isinstance(self.model, str) or not self.model:
                bad(f"method {self.method!r} needs model: the {self.draft_name}'s path")
            d = self.draft_tensor_parallel_size
            if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
                bad(f"draft_tensor_parallel_size must be a positive integer, got {d!r}")
            if self.quantization is not None:
                bad("quantization of the draft model is not supported (the draft runs unquantized, in the "
                    "engine's dtype)")
            if self.revision is not None:
                bad("revision of the draft model is not supported (model is a local path; nothing is downloaded)")
        elif self.model is not None:
            bad("model is for method 'draft_model' or 'eagle3'; n-gram drafts need none")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(f"{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max ({self.prompt_lookup_max})")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            bad(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            bad(f"disable_by_batch_size must be a positive integer or None, got {b!r}")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict of vLLM's keys, or that dict as JSON (`--speculative-config`)."""
        if value is None or isinstance(value, cls):
            return value
        value = json_dict(value, "speculative_config")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise EngineConfigError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        if "num_speculative_tokens" not in value:
            raise EngineConfigError("speculative_config needs num_speculative_tokens")
        return cls(**value)

    @property
    def uses_draft_model(self) -> bool:
        """Whether a network proposes the drafts, on the device inside the verify step (a draft model or an
        EAGLE-3 head): the scheduler reserves their rows."""
        return self.method in ("draft_model", "eagle3")

    def drafts_on_device(self, num_scheduler_steps: int) -> bool:
        """Whether verify-rounds launches propose the drafts on the device (verify_rounds.py): a draft model's or an
        EAGLE-3 head's always; n-gram lookups where a launch runs several rounds (atlasjax/ngram_lookup.py; with
        one round per launch the host looks them up)."""
        return self.uses_draft_model or num_scheduler_steps > 1

    def ngram_on_device(self, num_scheduler_steps: int) -> bool:
        """Whether n-gram drafts are looked up on the device (drafting.NgramDraft, in a token history it keeps)."""
        return self.method == "ngram" and self.drafts_on_device(num_scheduler_steps)

    @property
    def draft_name(self) -> str:
        return "EAGLE-3 head" if self.method == "eagle3" else "draft model"


MAX_SPECULATIVE_TOKENS = 15
# A draft model's drafts are proposed on the device inside the verify step: the scheduler reserves their rows with
# this token, which the step replaces (the drafts come back with the step's output).
DRAFT_ON_DEVICE = 0


def propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k drafts: the tokens after an earlier occurrence of the longest suffix n-gram (max_n down to min_n)
    of `tokens`: the latest occurrence with k tokens after it, else the earliest (the most tokens after it; a
    repeating stretch overlaps the suffix itself, whose latest occurrence is followed by one token only);
    [] when none recurs. One pass over the tokens (the last token's earlier positions), then only those."""
    t = np.asarray(tokens)
    size = len(t)
    if size < 2:
        return []
    ends = np.flatnonzero(t[:-1] == t[-1])      # where an occurrence of the 1-gram suffix ends
    found = ends if min_n <= 1 else None
    for n in range(2, max_n + 1):
        ends = ends[ends >= n - 1]
        ends = ends[t[ends - (n - 1)] == t[size - n]]
        if not ends.size:
            break
        if n >= min_n:
            found = ends                          # the longest n so far with an occurrence
    if found is None or not found.size:
        return []
    full = found[found + 1 + k <= size]
    start = int(full[-1] if full.size else found[0]) + 1
    return t[start:start + k].tolist()


class TokenHistory:
    """A request's tokens (prompt, then outputs) as a growing numpy array, so each step's lookup appends the new
    tokens instead of converting the whole list (a 32k-token context costs ~1 ms to convert)."""

    def __init__(self, prompt: list[int]):
        self._buf = np.empty(max(64, 2 * len(prompt)), np.int32)
        self._buf[:len(prompt)] = prompt
        self.num_prompt = self.size = len(prompt)

    def tokens(self, outputs: list[int]) -> np.ndarray:
        """The prompt and `outputs` (the request's output ids, which only grow)."""
        new = outputs[self.size - self.num_prompt:]
        if new:
            if self.size + len(new) > len(self._buf):
                self._buf = np.concatenate([self._buf[:self.size], np.empty(self.size + 2 * len(new), np.int32)])
            self._buf[self.size:self.size + len(new)] = new
            self.size += len(new)
        return self._buf[:self.size]


def request_tokens(req) -> np.ndarray:
    """req's known tokens, from its TokenHistory (made at its first lookup)."""
    if req.token_history is None:
        req.token_history = TokenHistory(req.prompt_token_ids)
    return req.token_history.tokens(req.output_token_ids)


def can_speculate(params) -> bool:
    """A request's sampling reads no per-token device state that only a decode step advances: no repetition,
    frequency or presence penalty (the generated-token counts), no bad words (the recent tokens)."""
    return (params.repetition_penalty == 1.0 and params.frequency_penalty == 0 and params.presence_penalty == 0
            and not params.bad_words)


def num_accepted(sampled, drafts: list[int]) -> int:
    """Drafts kept: those up to the first that differs from the token sampled at the position before it
    (sampled[j] is the model's token after the request's last token and drafts[:j])."""
    for j, d in enumerate(drafts):
        if int(sampled[j]) != d:
            return j
    return len(drafts)


@dataclasses.dataclass
class SpecStats:
    """Counters as vLLM's spec_decode metrics name them."""
    num_drafts: int = 0                  # request-steps that proposed drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)   # [k]: drafts kept at position j

    def record(self, num_drafts: int, accepted: int) -> None:
        if not num_drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per request that proposed drafts (accepted drafts + 1)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

"""OpenAI response pieces: usage, chat logprobs, legacy completion logprobs.

Engine logprobs arrive per generated token as {token_id: Logprob(logprob, rank, decoded_token)}
holding the top-k (ranked 1..k) plus the chosen token. JSON has no -inf, so values are clamped
to -9999 (as vLLM does).
"""
from __future__ import annotations

import math

from atlasjax.outputs import Logprob

MIN_LOGPROB = -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """cached_tokens: prompt tokens the prefix cache served (`prompt_tokens_details.cached_tokens`, as
    OpenAI reports prompt caching)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class CachedTokens:
    """Prompt tokens served by the prefix cache, counted once per prompt (jobs' first sequence, from its
    first delta; n > 1 siblings and a reasoning budget's continuation share or extend the prompt)."""

    def __init__(self):
        self._per_job: dict[int, int] = {}

    def add(self, job_index: int, delta) -> None:
        if delta.index == 0 and job_index not in self._per_job:
            self._per_job[job_index] = delta.num_cached_tokens

    @property
    def total(self) -> int:
        return sum(self._per_job.values())


def finite(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def token_text(token_id: int, decoded: str | None, as_ids: bool = False) -> str:
    """How a logprob entry names its token: its text, or `token_id:N` (vLLM's return_tokens_as_token_ids,
    and any token without a text)."""
    return f"token_id:{token_id}" if as_ids or decoded is None else decoded


def _chosen_and_top(entry: dict[int, Logprob], token_id: int, k: int | None = None,
                    as_ids: bool = False) -> tuple[float, dict]:
    """A logprob entry's chosen token's logprob and its top map ({token text: logprob}): every token of the
    entry, or with k the k best ranked and the chosen one."""
    top = {token_text(t, lp.decoded_token, as_ids): finite(lp.logprob) for t, lp in entry.items()
           if k is None or t == token_id or (lp.rank or k + 1) <= k}
    return finite(entry[token_id].logprob), top


def ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda item: item[1].rank)
    return ranked[:k]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_k: int, as_ids: bool = False) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs}]} for the given generated tokens."""
    def item(token_id: int, lp: Logprob) -> dict:
        text = token_text(token_id, lp.decoded_token, as_ids)
        return {"token": text, "logprob": finite(lp.logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, entries):
        content.append({**item(token_id, entry[token_id]),
                        "top_logprobs": [item(t, lp) for t, lp in ranked(entry, top_k)]})
    return {"content": content}


class CompletionLogprobs:
    """Accumulates the legacy {tokens, token_logprobs, top_logprobs, text_offset} of one choice."""

    def __init__(self, text_offset: int = 0, as_ids: bool = False):
        self.offset, self.as_ids = text_offset, as_ids

    def prompt(self, token_texts: list[str], token_ids: list[int] | None = None,
               entries: list[dict[int, Logprob] | None] | None = None, k: int = 0) -> dict:
        """Echoed prompt tokens with their logprobs (`RequestOutput.prompt_logprobs` entries; the first
        token has none, null) and the top k; all null without entries."""
        out = self._empty()
        for i, text in enumerate(token_texts):
            entry = entries[i] if entries and i < len(entries) else None
            if entry is None:
                self._push(out, text, None, None)
            else:
                self._push(out, text, *_chosen_and_top(entry, token_ids[i], k, self.as_ids))
        return out

    def generated(self, token_ids: list[int], entries: list[dict[int, Logprob]]) -> dict:
        out = self._empty()
        for token_id, entry in zip(token_ids, entries):
            self._push(out, token_text(token_id, entry[token_id].decoded_token, self.as_ids),
                       *_chosen_and_top(entry, token_id, as_ids=self.as_ids))
        return out

    @staticmethod
    def _empty() -> dict:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _push(self, out: dict, text: str, logprob, top) -> None:
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.offset)
        self.offset += len(text)

    @staticmethod
    def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> list | None:
        """vLLM's `prompt_logprobs` of a choice: per prompt token null (the first) or
        {token id: {logprob, rank, decoded_token}}."""
        if entries is None:
            return None
        return [None if entry is None else {str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                                     "decoded_token": lp.decoded_token} for t, lp in entry.items()}
                for entry in entries]

    @staticmethod
    def merge(a: dict | None, b: dict) -> dict:
        if a is None:
            return b
        return {key: a[key] + b[key] for key in a}

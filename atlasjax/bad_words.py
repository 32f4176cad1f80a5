"""vLLM's `bad_words`: words a request may not generate.

Each word is tokenized as it is and with a leading space (a separate entry when that gives other tokens of
the same count: the word inside a text), without special tokens. A sequence of one token bans that token
everywhere; a longer one bans its last token right after the request has *generated* the others (tokens of
the prompt do not count, as in vLLM). The device keeps each slot's sequences right-aligned in a
[MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS] table (-1 where there is no token) and the slot's last
MAX_BAD_WORD_TOKENS - 1 generated tokens (atlasjax/steps.py, atlasjax/sampling.py mask them).
"""
from __future__ import annotations

import numpy as np

from atlasjax.errors import InvalidRequestError

MAX_BAD_WORD_SEQS = 32      # token sequences per request (a word may give two)
MAX_BAD_WORD_TOKENS = 8     # tokens per sequence
HISTORY = MAX_BAD_WORD_TOKENS - 1   # generated tokens the device keeps per slot to match the longest prefix


def token_sequences(words: list[str] | None, tokenizer) -> list[list[int]]:
    """The token sequences the device bans for `words` (checked against the table's limits)."""
    if not words:
        return []
    if tokenizer is None:
        raise InvalidRequestError("bad_words need a model with a tokenizer")
    seqs: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced) if spaced and len(spaced) == len(plain) and spaced[0] != plain[0] else (plain,):
            if not ids:
                continue
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequestError(f"bad word {word!r} is {len(ids)} tokens long; at most "
                                          f"{MAX_BAD_WORD_TOKENS} are supported")
            if ids not in seqs:
                seqs.append(ids)
    if len(seqs) > MAX_BAD_WORD_SEQS:
        raise InvalidRequestError(f"bad_words give {len(seqs)} token sequences (each word as it is and after a "
                                  f"space); at most {MAX_BAD_WORD_SEQS} are supported")
    return seqs


def table(seqs: list[list[int]]) -> np.ndarray:
    """[MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS] int32: each sequence right-aligned, -1 elsewhere."""
    out = np.full((MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS), -1, np.int32)
    for i, ids in enumerate(seqs):
        out[i, MAX_BAD_WORD_TOKENS - len(ids):] = ids
    return out

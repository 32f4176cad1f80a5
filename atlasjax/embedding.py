"""`Embedder`: batches of token lists -> one pooled vector each, through the engine's model and params.

Inputs are sorted by length and cut into batches of at most `token_budget` padded tokens (a longer input
runs alone). Each batch pads its rows to a width of 16, 32, 48, ... 128 tokens, then eight steps per
doubling (160, 192, 224, 256, 320, ...: under 1/8 of padding past 64 tokens), and its row count to a
power of two, so a server compiles few programs: a few dozen widths x log2(budget / 16) row counts. Each
program runs the model over its own small KV pool (atlasjax/forward.py's `hidden_fn`; the engine's
pool and slots are not touched) and pools on the device, so only [B, embed] floats come back.
"""
from __future__ import annotations

import functools
import logging

import numpy as np

from atlasjax.errors import InvalidRequestError, UnsupportedModelError
from atlasjax.pooling import PoolerConfig, PoolingParams, finish, pool

log = logging.getLogger("atlasjax.embedding")
MIN_TOKENS = 16


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def padded_width(n: int) -> int:
    """The tokens a row of n tokens is padded to: a multiple of 16, then of an eighth of the next power of two."""
    step = max(MIN_TOKENS, _pow2_at_least(n) // 8)
    return -(-n // step) * step


def plan_batches(lengths: list[int], token_budget: int, max_len: int) -> list[tuple[list[int], int, int]]:
    """(indices into lengths, padded rows, padded tokens) per batch: longest inputs first, each batch at
    most token_budget padded tokens unless one input alone is longer."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, start = [], 0
    while start < len(order):
        tokens = min(padded_width(lengths[order[start]]), max(max_len, MIN_TOKENS))
        fits = max(1, token_budget // tokens)
        rows = 1 << (fits.bit_length() - 1)          # a power of two: few shapes
        take = order[start:start + rows]
        batches.append((take, min(rows, _pow2_at_least(len(take))), tokens))
        start += len(take)
    return batches


class Embedder:
    def __init__(self, runner, pooler: PoolerConfig, max_model_len: int, token_budget: int):
        self.runner, self.pooler = runner, pooler
        self.max_model_len, self.token_budget = max_model_len, token_budget
        self.num_programs = 0     # programs compiled (one per batch shape)
        self.num_batches = 0      # batches run

    @functools.cached_property
    def _program(self):
        import jax  # noqa: PLC0415

        from atlasjax.forward import hidden_fn  # noqa: PLC0415
        hidden_states, pooling_type = hidden_fn(self.runner), self.pooler.pooling_type

        def run(params, tokens, lengths):
            self.num_programs += 1     # (runs once per traced shape)
            return pool(hidden_states(params, tokens), lengths, pooling_type)
        return jax.jit(run)

    def check(self, token_lists: list[list[int]], params: list[PoolingParams]) -> list[list[int]]:
        """The token lists as they will be embedded (truncated where asked), or a clear error."""
        if self.pooler.unsupported:
            raise UnsupportedModelError(f"this model cannot serve embeddings: {self.pooler.unsupported}")
        if not token_lists:
            raise InvalidRequestError("embeddings need at least one input")
        out = []
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            if p.truncate_prompt_tokens is not None:
                keep = self.max_model_len if p.truncate_prompt_tokens == -1 else p.truncate_prompt_tokens
                ids = ids[-keep:]
            if not ids:
                raise InvalidRequestError(f"input {i} is empty")
            if p.dimensions is not None and p.dimensions > self.runner.cfg.hidden_size:
                raise InvalidRequestError(f"dimensions={p.dimensions} exceeds the model's embedding size "
                                          f"{self.runner.cfg.hidden_size}")
            if len(ids) > self.max_model_len:
                raise InvalidRequestError(f"input {i} has {len(ids)} tokens, more than max_model_len="
                                          f"{self.max_model_len} (truncate_prompt_tokens keeps the last N)")
            out.append(ids)
        return out

    def embed(self, token_lists: list[list[int]], params: list[PoolingParams]) -> list[np.ndarray]:
        """One float32 vector per token list (already `check`ed), in order."""
        pooled: list[np.ndarray | None] = [None] * len(token_lists)
        compiled = self.num_programs
        for indices, rows, tokens in plan_batches([len(t) for t in token_lists], self.token_budget,
                                                  self.max_model_len):
            batch = np.zeros((rows, tokens), np.int32)
            lengths = np.ones((rows,), np.int32)
            for row, i in enumerate(indices):
                batch[row, :len(token_lists[i])] = token_lists[i]
                lengths[row] = len(token_lists[i])
            vectors = np.asarray(self._program(self.runner.params, batch, lengths))
            self.num_batches += 1
            for row, i in enumerate(indices):
                pooled[i] = vectors[row]
        if self.num_programs > compiled:
            log.info("embeddings: compiled %d more program(s) (%d in all)", self.num_programs - compiled,
                     self.num_programs)
        return [finish(v, p, self.pooler) for v, p in zip(pooled, params)]

"""`Embedder`: batches of token lists -> one pooled vector each, through the engine's model and params.

Inputs are packed end to end (ragged, as the engine's prefill packs prompts), in order, into batches of at
most `token_budget` tokens and MAX_SEQS inputs; an input longer than the budget runs alone. Each batch is
dispatched before the previous one is read back, and `on_ready` hears as each one lands.
A batch is padded to a power of two of tokens (at least 16), so a server compiles one program per size:
about log2(budget / 16) of them, plus one per longer size a lone input reaches. Each program runs the
model over a KV pool of its own, sized for the batch (the engine's pool and slots are not touched), and
pools on the device per input (atlasjax/pooling.py), so only [MAX_SEQS, embed] floats come back.
"""
from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import os
from collections.abc import Callable

import numpy as np

from atlasjax.errors import AtlasJaxError, InvalidRequestError, UnsupportedModelError
from atlasjax.pooling import ClassifierHead, PoolerConfig, PoolingParams, finish, pool_ragged

log = logging.getLogger("atlasjax.embedding")
MIN_TOKENS = 16
MAX_SEQS = 64      # inputs per batch (the attention metadata's rows)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def batch_tokens(total: int, token_budget: int) -> int:
    """The padded size of a batch of `total` tokens: a power of two from 16, the budget at most (unless a lone
    input is longer)."""
    size = max(MIN_TOKENS, _pow2_at_least(total))
    return size if total > token_budget else min(size, token_budget)


def plan_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices into lengths per batch, in order (requests that came first finish first): each batch at most
    token_budget tokens and MAX_SEQS inputs, except a lone input longer than the budget."""
    batches: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if not batches or total + n > token_budget or len(batches[-1]) == MAX_SEQS:
            batches.append([])
            total = 0
        batches[-1].append(i)
        total += n
    return batches


def pack(token_lists: list[list[int]], num_tokens: int, page_size: int) -> dict[str, np.ndarray]:
    """One batch's arrays: tokens end to end, each input on pages of its own in a pool of
    num_tokens / page_size + MAX_SEQS pages; padding tokens write to the slot past the pool and belong to
    input MAX_SEQS (dropped by the pooling)."""
    num_pages = num_tokens // page_size + MAX_SEQS
    width = -(-num_tokens // page_size)
    b = dict(tokens=np.zeros(num_tokens, np.int32), positions=np.zeros(num_tokens, np.int32),
             slot_mapping=np.full(num_tokens, num_pages * page_size, np.int32),
             page_table=np.zeros((MAX_SEQS, width), np.int32), seq_lens=np.zeros(MAX_SEQS, np.int32),
             query_start=np.zeros(MAX_SEQS + 1, np.int32), num_seqs=np.int32(len(token_lists)),
             seq_ids=np.full(num_tokens, MAX_SEQS, np.int32))
    row = page = 0
    for s, ids in enumerate(token_lists):
        n = len(ids)
        pos = np.arange(n)
        pages = np.arange(page, page + -(-n // page_size), dtype=np.int32)
        page += len(pages)
        b["tokens"][row:row + n] = ids
        b["positions"][row:row + n] = pos
        b["slot_mapping"][row:row + n] = pages[pos // page_size] * page_size + pos % page_size
        b["page_table"][s, :len(pages)] = pages
        b["seq_lens"][s] = n
        b["seq_ids"][row:row + n] = s
        row += n
        b["query_start"][s + 1:] = row
    return b


class Embedder:
    def __init__(self, runner, pooler: PoolerConfig, max_model_len: int, token_budget: int,
                 classifier: ClassifierHead | None = None):
        self.runner, self.pooler, self.classifier = runner, pooler, classifier
        self.max_model_len, self.token_budget = max_model_len, token_budget
        self.num_programs = 0     # programs compiled (one per batch size)
        self._programs: dict = {}
        self.num_batches = 0      # batches run

    @functools.cached_property
    def _jit(self):
        import jax  # noqa: PLC0415

        from models.attention import AttentionMetadata  # noqa: PLC0415
        from models.transformer import init_kv_cache  # noqa: PLC0415
        runner, pooling_type = self.runner, self.pooler.pooling_type
        kv_heads = () if runner.plan is None else (runner.plan.num_kv_heads,)

        def run(params, b):
            num_pages = b["tokens"].shape[0] // runner.page_size + MAX_SEQS
            kv = init_kv_cache(runner.cfg, num_pages, runner.page_size, runner.kv_dtype, *kv_heads)
            meta = AttentionMetadata(slot_mapping=b["slot_mapping"], page_table=b["page_table"],
                                     seq_lens=b["seq_lens"], query_start=b["query_start"], num_seqs=b["num_seqs"])
            hidden, _ = runner.model.apply({"params": params}, b["tokens"], b["positions"], kv, meta)
            return pool_ragged(hidden, b["seq_ids"], b["query_start"], b["seq_lens"], pooling_type)
        return jax.jit(run)

    def _lower(self, size: int):
        return self._jit.lower(self.runner.params, pack([[0]], size, self.runner.page_size))

    def _program(self, size: int):
        """The compiled program for batches of `size` tokens (compiled on first use)."""
        if size not in self._programs:
            self._programs[size] = self._lower(size).compile()
            self.num_programs += 1
        return self._programs[size]

    def batch_sizes(self) -> list[int]:
        """Every padded size a batch can have: the powers of two from 16 to the budget (and the budget), then
        on to max_model_len's for a lone longer input."""
        limit = max(self.token_budget, self.max_model_len)
        totals = [1 << k for k in range(MIN_TOKENS.bit_length() - 1, limit.bit_length())] + [self.token_budget, limit]
        return sorted({batch_tokens(t, self.token_budget) for t in totals if t <= limit})

    def warmup(self, threads: int | None = None) -> None:
        """Compile every batch size: each lowered here, the XLA compiles in `threads` threads (outside the GIL;
        default $ATLASJAX_COMPILE_THREADS, else up to 8)."""
        todo = [(size, self._lower(size)) for size in self.batch_sizes() if size not in self._programs]
        threads = threads or int(os.environ.get("ATLASJAX_COMPILE_THREADS", "0")) or min(8, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            for (size, _), compiled in zip(todo, pool.map(lambda item: item[1].compile(), todo)):
                self._programs[size] = compiled
                self.num_programs += 1

    def _check_task(self, task: str) -> None:
        if task == "embed" and self.pooler.unsupported:
            raise UnsupportedModelError(f"this model cannot serve embeddings: {self.pooler.unsupported}")
        if task == "classify" and self.classifier is None:
            raise UnsupportedModelError("this model has no classification head (a *ForSequenceClassification "
                                        "checkpoint's `score` layer): it cannot classify")
        if task == "classify" and self.pooler.pooling_type != "last":
            raise UnsupportedModelError(f"classification reads the last token's state; this engine pools "
                                        f"{self.pooler.pooling_type} (pooling_type)")

    def check(self, token_lists: list[list[int]], params: list[PoolingParams]) -> list[list[int]]:
        """The token lists as they will be embedded (truncated where asked), or a clear error."""
        if not token_lists:
            raise InvalidRequestError("embeddings need at least one input")
        for task in {p.task for p in params}:
            self._check_task(task)
        out = []
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            if p.truncate_prompt_tokens is not None:
                keep = self.max_model_len if p.truncate_prompt_tokens == -1 else p.truncate_prompt_tokens
                ids = ids[-keep:]
            if not ids:
                raise InvalidRequestError(f"input {i} is empty")
            if p.task == "classify" and (p.dimensions is not None or p.normalize):
                raise InvalidRequestError("dimensions and normalize apply to embeddings, not to classification")
            if p.dimensions is not None and p.dimensions > self.runner.cfg.hidden_size:
                raise InvalidRequestError(f"dimensions={p.dimensions} exceeds the model's embedding size "
                                          f"{self.runner.cfg.hidden_size}")
            if len(ids) > self.max_model_len:
                raise InvalidRequestError(f"input {i} has {len(ids)} tokens, more than max_model_len="
                                          f"{self.max_model_len} (truncate_prompt_tokens keeps the last N)")
            out.append(ids)
        return out

    def embed(self, token_lists: list[list[int]], params: list[PoolingParams],
              on_ready: Callable[[list[np.ndarray]], None] | None = None) -> list[np.ndarray]:
        """One float32 vector per token list (already `check`ed), in order. on_ready(vectors): the vectors
        final so far, the first ones (called as each batch is read back, while the next one runs)."""
        pooled: list[np.ndarray] = []
        compiled = self.num_programs
        in_flight = None
        for indices in plan_batches([len(t) for t in token_lists], self.token_budget) + [None]:
            launched = None
            if indices is not None:     # dispatched (asynchronously) before the previous batch is read
                batch = [token_lists[i] for i in indices]
                size = batch_tokens(sum(map(len, batch)), self.token_budget)
                out = self._program(size)(self.runner.params, pack(batch, size, self.runner.page_size))
                launched = (out, len(indices))
                self.num_batches += 1
            if in_flight is not None:
                out, count = in_flight
                vectors = np.asarray(out)
                for row in range(count):
                    i = len(pooled)
                    pooled.append(finish(vectors[row], params[i], self.pooler, self.classifier))
                if on_ready is not None:
                    on_ready(pooled)
            in_flight = launched
        if self.num_programs > compiled:
            log.info("embeddings: compiled %d more program(s) (%d in all)", self.num_programs - compiled,
                     self.num_programs)
        return pooled

    def embed_requests(self, requests: list[tuple[list, object]], tokenize: Callable[[object], list[int]], stats,
                       on_done: Callable | None = None) -> list:
        """`LLMEngine.embed_requests`: several callers' (prompts, params) in shared batches, in order; per request
        its vectors, or the error that refuses it. tokenize: a prompt's token ids (checked); stats: the engine's
        EngineStats, which count the inputs and tokens embedded."""
        out: list = [None] * len(requests)
        ready = []
        for i, (prompts, params) in enumerate(requests):
            try:
                params = params if isinstance(params, list) else [params or PoolingParams()] * len(prompts)
                if len(params) != len(prompts):
                    raise InvalidRequestError(f"got {len(params)} pooling params for {len(prompts)} inputs")
                ready.append((i, self.check([tokenize(p) for p in prompts], params), params))
            except AtlasJaxError as e:
                out[i] = e
                if on_done is not None:
                    on_done(i, e)
        if not ready:
            return out
        ids = [t for _, toks, _ in ready for t in toks]
        ends = list(itertools.accumulate(len(toks) for _, toks, _ in ready))
        done = 0

        def landed(vectors: list) -> None:     # the first len(vectors) are final
            nonlocal done
            while done < len(ready) and ends[done] <= len(vectors):
                i, toks, _ = ready[done]
                out[i] = list(zip(toks, vectors[ends[done] - len(toks):ends[done]]))
                stats.num_embedding_inputs += len(toks)       # counted before the answer leaves
                stats.embedding_tokens += sum(map(len, toks))
                if on_done is not None:
                    on_done(i, out[i])
                done += 1
        self.embed(ids, [p for _, _, ps in ready for p in ps], on_ready=landed)
        return out

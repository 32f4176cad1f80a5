"""LLMEngine: requests in, token deltas out, one `step()` at a time (single-threaded).

A step asks the scheduler for work, packs it into the fixed bucket shapes, dispatches the
prefill and decode steps, reads their tokens back and turns them into text deltas with
incremental detokenization and stop checks. `LLM` drives it synchronously; `AsyncLLM` runs it
in a thread.

Asynchronous scheduling (the default): `step()` schedules and dispatches step N+1 before it reads
step N back, so the host work (scheduling, packing, detokenization, stop checks) runs while the
device computes. The cost is a one-step lag:
- step N+1's decode takes the tokens step N sampled straight from the device (`Request`'s pending
  token: the scheduler counts it, the decode gathers it by row);
- a request that step N finishes (stop token, stop string, max_tokens) or that is aborted was
  already scheduled into step N+1: that step's token for it is dropped unread (no output, logprob,
  usage or delta), and its pages return only once step N+1 has run. Its slot is free at once: the
  next request's admit step resets the slot's penalty row (the dropped token's count included)
  and runs after step N+1 on the device, as every step is chained through the donated state;
- a request whose pending token is its last (max_tokens) is not scheduled again.
With `async_scheduling=False` each step is read back before the next is scheduled.

Multi-step decoding (`num_scheduler_steps` K > 1): a decode-only step runs up to K iterations per
request in one launch (scheduler.py says when). The host reads the K tokens back together, applies
the stop checks token by token, drops what follows a stop, and returns one delta per request.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax import distributed, metrics, weights_summary
from atlasjax.engine_config import EngineConfig, resolve_kv_cache_dtype, resolve_scheduler_steps
from atlasjax.errors import EngineConfigError, InvalidRequestError
from atlasjax.kv_budget import auto_num_pages
from atlasjax.outputs import Logprob, StreamDelta
from atlasjax.page_pool import PagePool
from atlasjax.request import Request
from atlasjax.runner import ModelRunner
from atlasjax.sampling import pack_rows, plan_rows
from atlasjax.sampling_params import MAX_LOGPROBS, SamplingParams
from atlasjax.scheduler import Scheduler, SchedulerOutput
from atlasjax.step_options import use_process_flags
from atlasjax.steps import StepOutput
from atlasjax.tokenizer import IncrementalDetokenizer, read_chat_template

log = logging.getLogger("atlasjax.engine")


@dataclasses.dataclass
class _Launched:
    """A dispatched step whose outputs have not been read back yet."""
    sched: SchedulerOutput
    prefill: StepOutput | None
    decode: StepOutput | None
    record_prompt_logprobs: list[bool]     # per prefill chunk
    sample_rows: dict[Request, int]        # request -> row of its new token in [prefill rows | decode rows]
    with_logprobs: bool                    # some sampled row asked for logprobs: read them back too
    num_steps: int = 1                     # decode iterations the launched decode runs (1, or the compiled K)


@dataclasses.dataclass
class _HostOutput:
    """A step's outputs on the host: [num_steps, prefill rows (num_slots) then decode rows (the decode's
    bucket)]; the prefill rows have one token, in iteration 0."""
    tokens: np.ndarray
    logprob: np.ndarray | None
    top_vals: np.ndarray | None
    top_ids: np.ndarray | None
    prompt: tuple | None


def resolve_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return jnp.dtype(name)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None):
        from atlasjax.model_source import (  # noqa: PLC0415
            load_for_engine, shard_loaded, with_user_settings, with_weight_settings)
        use_process_flags(config.tensor_parallel_size)   # before anything starts the jax backend
        self.config = config = dataclasses.replace(config, num_scheduler_steps=resolve_scheduler_steps(
            config.num_scheduler_steps, jax.default_backend()))
        self.dtype = resolve_dtype(config.dtype)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        # read before the model loads: a missing or broken template fails at once
        chat_template = None if config.chat_template is None else read_chat_template(config.chat_template)
        given = loaded
        self.loaded = with_user_settings(shard_loaded(loaded or load_for_engine(config, self.dtype),
                                                      config.tensor_parallel_size, self.dtype), config, chat_template)
        self.model_config = cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.generation_defaults = self.loaded.generation
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 4096)
        if config.num_pages:
            self._check_num_pages(config.num_pages)   # before any device work
        # Rows of the fixed-shape steps: at least 8 on GPU, where XLA runs a one-row matmul as a much
        # slower matrix-vector kernel (8B bs=1 step on an H100: 7.8 ms with 1 row, 6.0 ms with 8).
        min_rows = 8 if jax.default_backend() == "gpu" else 1
        self.num_slots = max(config.max_num_seqs, min_rows)
        # The runner holds the params from here on (in its execution layout: `runner.checkpoint_params()`
        # gives them back as loaded); a tree this engine loaded or sharded itself is handed over whole.
        params, self.loaded = self.loaded.params, dataclasses.replace(self.loaded, params=None)
        own_params = given is None or params is not given.params
        params = with_weight_settings(params, config, cfg, self.tokenizer, self.dtype, self.kv_dtype,
                                      self.max_model_len, plan=self.loaded.plan)
        self.weights_summary = weights_summary.describe(params)   # which format each weight runs in
        log.info("%s: %s", self.loaded.source, self.weights_summary)
        self.runner = ModelRunner(cfg, params, dtype=self.dtype, kv_dtype=self.kv_dtype, page_size=config.page_size,
                                  max_num_seqs=self.num_slots, max_model_len=self.max_model_len,
                                  prefill_buckets=config.prefill_buckets(),
                                  decode_buckets=config.decode_buckets(self.num_slots, min_rows),
                                  attn_backend=config.attention_backend, plan=self.loaded.plan,
                                  own_params=own_params,
                                  prompt_logprobs_tokens=config.prompt_logprobs_tokens)
        del params
        # The KV pool is sized from the memory left once the params are in their execution layout.
        num_pages = distributed.broadcast_int(   # all hosts agree
            config.num_pages or auto_num_pages(config, cfg, self.kv_dtype, self.max_model_len, self.runner.params,
                                               self.loaded.plan))
        self._check_num_pages(num_pages)
        if config.compile_at_start:
            t0 = time.perf_counter()
            self.runner.warmup(config.num_scheduler_steps, num_pages=num_pages)
            log.info("compiled %d step shapes and loaded %d from the program store in %.1f s",
                     self.runner.num_compiles, self.runner.num_loaded, time.perf_counter() - t0)
        self.runner.allocate(num_pages)
        self.pool = PagePool(num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   num_scheduler_steps=config.num_scheduler_steps,
                                   prompt_logprobs_tokens=config.prompt_logprobs_tokens)
        self._channel = None
        if distributed.is_multiprocess():   # process 0 drives; the others replay its steps (`follow`)
            self._channel = distributed.StepChannel()
            if distributed.is_leader():
                self.runner = distributed.BroadcastingRunner(self.runner, self._channel)
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else cfg.eos_token_ids
        self.eos_token_ids = tuple(dict.fromkeys(eos + self.generation_defaults.eos_token_ids))
        self.requests: dict[str, list[Request]] = {}   # request id -> its n sequences
        self._detok: dict[Request, IncrementalDetokenizer] = {}
        self._rng = random.Random(config.seed)
        self.stats = metrics.EngineStats()
        self._async_scheduling = config.async_scheduling
        self._in_flight: _Launched | None = None     # async: the step dispatched by the previous step() call

    def _check_num_pages(self, num_pages: int) -> None:
        pages_per_seq = -(-self.max_model_len // self.config.page_size)
        if num_pages < pages_per_seq:
            raise EngineConfigError(
                f"the KV pool ({num_pages} pages of {self.config.page_size} tokens) cannot hold one sequence of "
                f"max_model_len={self.max_model_len} ({pages_per_seq} pages): lower max_model_len or add pages")

    # ---- multi-host (atlasjax/distributed.py)
    def follow(self) -> None:
        """On a process other than 0: run process 0's device steps until it stops the followers."""
        if self._channel is None or distributed.is_leader():
            raise EngineConfigError("follow() is for processes other than 0 of a multi-host run")
        distributed.follow(self.runner, self._channel)

    def stop_followers(self) -> None:
        """On process 0: let the other processes' `follow()` return (call once, when done)."""
        if self._channel is not None and distributed.is_leader():
            self.runner.stop_followers()
            self._channel = None

    # ---- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> list[Request]:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        token_ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
        max_tokens = self._check_length(len(token_ids), params)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        seqs = []
        for i in range(params.n):
            seed = base_seed if i == 0 else hash((base_seed, i)) & 0x7FFFFFFF
            req = Request(f"{request_id}" if params.n == 1 else f"{request_id}#{i}", list(token_ids), params, seed,
                          max_tokens, self.eos_token_ids, arrival_time or time.monotonic())
            req.index, req.parent_id = i, request_id
            if self.tokenizer is not None:
                self._detok[req] = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            seqs.append(req)
            self.scheduler.add(req)
        self.requests[request_id] = seqs
        self.stats.num_requests += 1
        return seqs

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _check_length(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(f"the prompt has {prompt_len} tokens, more than max_model_len={limit} allows "
                                      f"(at most {limit - 1} leaving room for one generated token)")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise InvalidRequestError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                                      f"{prompt_len + max_tokens} exceeds max_model_len={limit}")
        if -(-(prompt_len + max_tokens) // self.pool.page_size) > self.pool.num_pages:
            raise InvalidRequestError("the request cannot fit in the KV cache even on its own")
        return max_tokens

    def abort(self, request_id: str) -> bool:
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for req in seqs:
            if not req.is_finished:
                self.scheduler.finish(req, "abort")
            self._detok.pop(req, None)
        self.stats.num_aborted += 1
        self.stats.refresh(self)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    @property
    def async_scheduling(self) -> bool:
        return self._async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        """Switch modes (benchmarks compare them on one engine); only between steps with none in flight."""
        if self._in_flight is not None:
            raise RuntimeError("a step is in flight: run step() until has_unfinished() is False first")
        self._async_scheduling = bool(on)

    # ---- one iteration
    def step(self) -> list[StreamDelta]:
        """Schedule and dispatch a step; return the deltas of the step read back now: this one
        (synchronous) or the one dispatched by the previous call (asynchronous)."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        launched = None if sched.is_empty else self._launch(sched)
        if self._async_scheduling:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        if launched is None and done is None:
            return []
        deltas = self._process(done) if done is not None else []
        self.stats.record_step(time.perf_counter() - t0, sched, self)
        return deltas

    def _launch(self, sched: SchedulerOutput) -> _Launched:
        """Dispatch the admit, prefill and decode steps (asynchronous: nothing waits for the device)."""
        for req in sched.admitted:
            self.runner.admit(req.slot, req.all_token_ids, len(req.prompt_token_ids), req.params.logit_bias)
        prefill_out, record_lp = self._run_prefill(sched) if sched.prefills else (None, [])
        # a multi-step launch runs the compiled K iterations (each request its own sched.steps of them)
        num_steps = self.config.num_scheduler_steps if sched.num_steps > 1 else 1
        decode_out = self._run_decode(sched, num_steps) if sched.decodes else None
        s = self.num_slots
        rows = {c.request: i for i, c in enumerate(sched.prefills) if c.completes_prompt}
        rows.update((req, s + r) for r, req in enumerate(sched.decodes))   # _run_decode's row order
        for req in rows:
            req.num_pending_tokens += sched.steps.get(req, 1)
        self.scheduler.dispatched(sched)
        launched = _Launched(sched, prefill_out, decode_out, record_lp, rows,
                             any(r.params.logprobs is not None for r in rows), num_steps)
        for x in self._arrays_to_read(launched):
            x.copy_to_host_async()      # start the transfers now; they complete when the step does
        return launched

    def _run_prefill(self, sched: SchedulerOutput):
        ps, s = self.pool.page_size, self.num_slots
        total = sum(c.num_tokens for c in sched.prefills)
        # decided now: a preemption before a chunk is read back must not drop its rows
        record_lp = [c.request.records_prompt_logprobs for c in sched.prefills]
        t = self.runner.bucket_for(total, with_prompt_logprobs=any(record_lp))
        b = dict(tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
                 slot_mapping=np.full(t, self.pool.num_pages * ps, np.int32),
                 page_table=np.zeros((s, self.runner.pages_per_seq), np.int32), seq_lens=np.zeros(s, np.int32),
                 query_start=np.zeros(s + 1, np.int32), num_seqs=np.int32(len(sched.prefills)),
                 sample_rows=np.zeros(s, np.int32), slot_ids=np.zeros(s, np.int32), commit=np.zeros(s, bool),
                 next_tokens=np.full(t, -1, np.int32))
        rows, row = [None] * s, 0
        for i, c in enumerate(sched.prefills):
            req, n = c.request, c.num_tokens
            assert not req.num_pending_tokens, "a prefilling request has no token on the device"
            ids = req.all_token_ids
            pos = np.arange(c.start, c.start + n)
            pages = np.asarray(req.pages, np.int32)
            b["tokens"][row:row + n] = ids[c.start:c.start + n]
            b["positions"][row:row + n] = pos
            b["slot_mapping"][row:row + n] = pages[pos // ps] * ps + pos % ps
            b["page_table"][i, :len(pages)] = pages
            b["seq_lens"][i] = c.start + n
            b["sample_rows"][i] = row + n - 1
            b["slot_ids"][i] = req.slot
            b["commit"][i] = c.completes_prompt
            nxt = ids[c.start + 1:c.start + n + 1]
            b["next_tokens"][row:row + len(nxt)] = nxt
            rows[i] = (req.params, req.seed, req.num_generated, req.eos_token_ids)
            row += n
            b["query_start"][i + 1:] = row
        f, ints = pack_rows(rows, s)
        return self.runner.prefill(b, f, ints, with_prompt_logprobs=any(record_lp)), record_lp

    def _run_decode(self, sched: SchedulerOutput, num_steps: int):
        """Row r of the step runs sched.decodes[r]; the rows are the smallest decode bucket that holds them."""
        n = self.runner.decode_rows_for(len(sched.decodes))
        tokens = np.zeros(n, np.int32)
        page_table = np.zeros((n, self.runner.pages_per_seq), np.int32)
        seq_lens = np.zeros(n, np.int32)
        slots = np.full(n, self.num_slots, np.int32)   # padding rows: out of range, nothing is counted
        rows = [None] * n
        row_steps = np.ones(n, np.int32)
        prev = self._in_flight
        for r, req in enumerate(sched.decodes):
            if req.num_pending_tokens:    # its last token is still on the device: gather it there
                tokens[r] = -1 - prev.sample_rows[req]
            else:
                tokens[r] = req.all_token_ids[-1]
            page_table[r, :len(req.pages)] = req.pages
            seq_lens[r] = req.num_total_tokens
            slots[r] = req.slot
            rows[r] = (req.params, req.seed, req.num_generated, req.eos_token_ids)
            row_steps[r] = sched.steps.get(req, 1)
        f, ints = pack_rows(rows, n)
        prev_tokens = (None, None) if prev is None else \
            tuple(None if o is None else o.gather_tokens for o in (prev.prefill, prev.decode))
        return self.runner.decode(tokens, page_table, seq_lens, f, ints, prev_tokens, plan_rows(rows),
                                  row_steps if num_steps > 1 else None, num_steps, slots)

    # ---- results
    def _arrays_to_read(self, step: _Launched) -> list[jax.Array]:
        """Only what the host needs: tokens, and logprobs when some row asked for them."""
        arrays = []
        for out in (step.prefill, step.decode):
            if out is not None:
                arrays.append(out.tokens)
                if step.with_logprobs:
                    arrays += [out.logprob, out.top_vals, out.top_ids]
        if step.prefill is not None and step.prefill.prompt is not None:
            arrays += list(step.prefill.prompt)
        return arrays

    def _read_back(self, step: _Launched) -> _HostOutput:
        """The one blocking device-to-host transfer of a step (returns once the step has run)."""
        s, k = self.num_slots, MAX_LOGPROBS
        want = [None if o is None else (o.tokens, (o.logprob, o.top_vals, o.top_ids) if step.with_logprobs else None)
                for o in (step.prefill, step.decode)]
        t0 = time.perf_counter()
        got, prompt = jax.device_get((want, None if step.prefill is None else step.prefill.prompt))
        self.stats.read_wait_seconds += time.perf_counter() - t0
        n = step.num_steps

        def steps_axis(x, rows, dtype, tail=()):   # -> [n, rows, *tail]: single-step outputs are iteration 0
            if x is None:
                return np.zeros((n, rows, *tail), dtype)
            x = x.reshape(-1, rows, *tail)
            return x if len(x) == n else np.concatenate([x, np.zeros((n - len(x), rows, *tail), dtype)])

        parts = [(None, None) if g is None else g for g in got]
        # the prefill part always spans s rows (decode rows follow it); the decode part its bucket's rows
        widths = (s, 0 if got[1] is None else got[1][0].shape[-1])
        host = _HostOutput(np.concatenate([steps_axis(p[0], w, np.int32) for p, w in zip(parts, widths)], axis=1),
                           None, None, None, prompt)
        if step.with_logprobs:
            host.logprob, host.top_vals, host.top_ids = (
                np.concatenate([steps_axis(None if p[1] is None else p[1][j], w, dt, tail)
                                for p, w in zip(parts, widths)], axis=1)
                for j, dt, tail in ((0, np.float32, ()), (1, np.float32, (k,)), (2, np.int32, (k,))))
        return host

    def _process(self, step: _Launched) -> list[StreamDelta]:
        host = self._read_back(step)
        self.scheduler.completed(step.sched)
        deltas, row = [], 0
        for i, c in enumerate(step.sched.prefills):
            req = c.request
            if step.record_prompt_logprobs[i]:
                self._record_prompt_logprobs(req, c, host.prompt, row)
            row += c.num_tokens
            self.stats.prompt_tokens += c.num_tokens
        for req, r in step.sample_rows.items():
            delta = None
            for j in range(step.sched.steps.get(req, 1)):
                # A request finished (or aborted) while this step ran, or at an earlier token of this
                # step: its tokens from here on are dropped unread.
                if req.is_finished:
                    break
                delta = _merged(delta, self._append_token(req, host, r, j))
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _append_token(self, req: Request, host: _HostOutput, row: int, j: int = 0) -> StreamDelta:
        """Token j of this step's row for req (j > 0: a later iteration of a multi-step decode)."""
        token = int(host.tokens[j, row])
        req.num_pending_tokens -= 1
        req.output_token_ids.append(token)
        self.stats.generation_tokens += 1
        p = req.params
        new_lp = None
        if p.logprobs is not None:
            new_lp = [self._logprob_dict(token, float(host.logprob[j, row]), host.top_vals[j, row],
                                         host.top_ids[j, row], p.logprobs)]
            req.logprobs.extend(new_lp)
        num_out = len(req.output_token_ids)
        finish, stop_reason = None, None
        is_stop_token = (token in req.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if is_stop_token and num_out > p.min_tokens - 1:
            finish, stop_reason = "stop", token
        text = ""
        detok = self._detok.get(req)
        if detok is not None and not is_stop_token:
            text = detok.add(token)
        prev_len = len(req.text)
        req.text += text
        if finish is None and p.stop and num_out >= p.min_tokens:
            hit = _find_stop(req.text, p.stop, prev_len)
            if hit is not None:
                idx, s = hit
                req.text = req.text[:idx + (len(s) if p.include_stop_str_in_output else 0)]
                finish, stop_reason = "stop", s
        if finish is None and (num_out >= req.max_tokens or req.num_tokens >= self.max_model_len):
            finish = "length"
        # Hold back text that might still become a stop string.
        emitted = req.emitted_chars
        hold = 0 if finish or not p.stop else max(len(s) for s in p.stop) - 1
        upto = max(emitted, len(req.text) - hold)
        new_text = req.text[emitted:upto]
        req.emitted_chars = upto
        if finish:
            req.stop_reason = stop_reason
            self.scheduler.finish(req, finish)
            self.stats.record_finish(req)
        return StreamDelta(req.parent_id, req.index, [token], new_text, bool(finish), finish, stop_reason, new_lp,
                           len(req.prompt_token_ids), num_out, req.num_cached_tokens or 0,
                           req.prompt_logprobs if num_out == 1 else None)

    def _logprob_dict(self, token, lp, top_vals, top_ids, k) -> dict[int, Logprob]:
        d = {}
        for rank, (tid, val) in enumerate(zip(top_ids[:k], top_vals[:k]), start=1):
            d[int(tid)] = Logprob(float(val), rank, self._tok_str(tid))
        if token not in d:
            d[token] = Logprob(lp, None, self._tok_str(token))
        return d

    def _tok_str(self, tid):
        return self.tokenizer.decode([int(tid)], skip_special_tokens=False) if self.tokenizer else None

    def _record_prompt_logprobs(self, req: Request, c, prompt_out, row: int) -> None:
        """Append the logprobs of the prompt tokens that chunk c's rows (from `row`) predict, those not recorded
        yet: a request preempted mid-prompt prefills its prompt again from a position already recorded (or
        earlier), and chunks are read back in order, so each position is recorded once and in order."""
        chosen, vals, ids = prompt_out
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        assert len(req.prompt_logprobs) > c.start, "a prompt-logprob chunk left a gap"
        k = req.params.prompt_logprobs
        for pos in range(len(req.prompt_logprobs), min(c.start + c.num_tokens + 1, len(req.prompt_token_ids))):
            r = row + pos - 1 - c.start      # the row that predicts prompt token pos
            req.prompt_logprobs.append(self._logprob_dict(req.prompt_token_ids[pos], float(chosen[r]), vals[r],
                                                          ids[r], k))

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (its pages are already free)."""
        for req in self.requests.pop(request_id, []):
            self._detok.pop(req, None)


def _merged(a: StreamDelta | None, b: StreamDelta) -> StreamDelta:
    """One delta for consecutive tokens of a sequence (a multi-step decode's)."""
    if a is None:
        return b
    lp = None if a.new_logprobs is None and b.new_logprobs is None else (a.new_logprobs or []) + (b.new_logprobs or [])
    return dataclasses.replace(b, new_token_ids=a.new_token_ids + b.new_token_ids, new_text=a.new_text + b.new_text,
                               new_logprobs=lp)


def _find_stop(text: str, stops: list[str], prev_len: int):
    best = None
    for s in stops:
        idx = text.find(s, max(0, prev_len - len(s) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best

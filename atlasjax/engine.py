"""LLMEngine: requests in, token deltas out, one `step()` at a time (single-threaded).

A step asks the scheduler for work, dispatches it (step_launch.py: packed into the fixed bucket shapes by
step_packing.py, run by the runner), reads its tokens back (step_readback.py) and turns them
into text deltas with incremental detokenization and stop checks (output_processor.py). `LLM`
drives it synchronously; `AsyncLLM` runs it in a thread.

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
import functools
import logging
import os
import random
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax import bad_words, distributed, hub, long_context_decode, metrics, pause, weights_summary
from atlasjax.engine_config import (EngineConfig, resolve_kv_cache_dtype, resolve_max_model_len,
                                    resolve_scheduler_steps)
from atlasjax.draft_model import load_speculative_draft
from atlasjax.errors import EngineConfigError, InvalidRequestError
from atlasjax.kv_budget import auto_num_pages
from atlasjax.kv_disk import check_directory
from atlasjax.kv_offload import check_host_memory, host_tier
from atlasjax.lora import LoRAManager, LoRARequest
from atlasjax.output_processor import OutputProcessor
from atlasjax.outputs import StreamDelta
from atlasjax.page_pool import PagePool
from atlasjax.pooling import PoolingParams, read_pooler_config
from atlasjax.profiling import Profiler, profiler_dir
from atlasjax.prompts import check_cache_salt
from atlasjax.request import Request
from atlasjax.runner import ModelRunner
from atlasjax.sampling_params import SamplingParams
from atlasjax.scheduler import Scheduler
from atlasjax.sleep_mode import SleepState
from atlasjax.step_options import use_process_flags
from atlasjax.step_launch import StepLauncher
from atlasjax.step_readback import LaunchedStep, read_back
from atlasjax.drafting import NgramDraft
from atlasjax.tokenizer import read_chat_template
from atlasjax.waiting_queue import check_priority

log = logging.getLogger("atlasjax.engine")
# tokens per embedding batch on a GPU, beside generation / on a pooling runner (elsewhere: max_num_batched_tokens;
# a larger max_num_batched_tokens raises it): 0.6B shapes on an H200 ran 291k / 315k / 305k tok/s at 8 / 16 / 32k
EMBED_TOKEN_BUDGET = 8192
POOLING_TOKEN_BUDGET = 16384


def resolve_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return jnp.dtype(name)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None):
        use_process_flags(config.tensor_parallel_size)   # before anything starts the jax backend
        self.config = config = dataclasses.replace(
            config, num_scheduler_steps=resolve_scheduler_steps(config.num_scheduler_steps, jax.default_backend()),
            model=hub.resolve(config.model, revision=config.revision),
            tokenizer=hub.resolve(config.tokenizer, "tokenizer"))
        self.speculative = config.speculative_config
        self.dtype = resolve_dtype(config.dtype)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        # Rows of the fixed-shape steps: at least 8 on GPU, where XLA runs a one-row matmul as a much
        # slower matrix-vector kernel (8B bs=1 step on an H100: 7.8 ms with 1 row, 6.0 ms with 8).
        min_rows = 8 if jax.default_backend() == "gpu" else 1
        self.num_slots = max(config.max_num_seqs, min_rows)
        params, own_params = self._load(config, loaded)
        self.runner = self._build_runner(config, params, own_params, config.decode_buckets(self.num_slots, min_rows))
        del params
        self.lora = None   # LoRA adapters' device slots and host copies (atlasjax/lora.py)
        if config.enable_lora:
            if distributed.is_multiprocess():
                raise EngineConfigError("LoRA adapters across several hosts are not supported yet (enable_lora)")
            self.lora = LoRAManager(self.runner, self.model_config, max_loras=config.max_loras,
                                    max_lora_rank=config.max_lora_rank, max_cpu_loras=config.max_cpu_loras)
        self.pooler = read_pooler_config(config.model, config.pooling_type)
        cannot_generate = self.loaded.pooling_model or self.loaded.classifier is not None
        self.pooling_only = config.runner == "pooling" or (config.runner == "auto" and cannot_generate)
        if self.pooling_only and config.runner == "auto":
            log.info("runner: pooling (the checkpoint has no LM head: embeddings and classification only; "
                     "runner='generate' generates anyway)")
        num_pages = self._num_pages(config)
        if config.compile_at_start:
            self._compile(config, num_pages)
        self.runner.allocate(num_pages)
        self.pool = PagePool(num_pages, config.page_size, config.enable_prefix_caching)
        self.kv_offload = None if self.pooling_only else host_tier(config, self.pool, self.runner,
                                                                   weights_named=loaded is None)
        self.scheduler = Scheduler(self.pool, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   num_scheduler_steps=config.num_scheduler_steps,
                                   prompt_logprobs_tokens=config.prompt_logprobs_tokens,
                                   policy=config.scheduling_policy, speculative=self.speculative, lora=self.lora)
        self._channel = None
        if distributed.is_multiprocess():   # process 0 drives; the others replay its steps (`follow`)
            self._channel = distributed.StepChannel()
            if distributed.is_leader():
                self.runner = distributed.BroadcastingRunner(self.runner, self._channel)
        self.launcher = StepLauncher(self.runner, self.scheduler, self.pool, num_slots=self.num_slots,
                                     num_scheduler_steps=config.num_scheduler_steps, kv_offload=self.kv_offload,
                                     lora=self.lora)
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else self.model_config.eos_token_ids
        self.eos_token_ids = tuple(dict.fromkeys(eos + self.generation_defaults.eos_token_ids))
        self.requests: dict[str, list[Request]] = {}   # request id -> its n sequences
        self._rng = random.Random(config.seed)
        self.stats = metrics.EngineStats()
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.scheduler, self.stats)
        self._async_scheduling = config.async_scheduling
        # verify-rounds launches scheduled behind one another (verify_rounds.py); off: each read back first (to measure)
        self._pipeline_verify = os.environ.get("ATLASJAX_PIPELINE_VERIFY", "on") != "off"
        if self.speculative is not None:
            spec = self.speculative
            log.info("speculative decoding: %s drafts, %s", spec.draft_name if spec.uses_draft_model else "n-gram",
                     spec)
        self.sleep_state = SleepState()    # what `LLM.sleep` released (atlasjax/sleep_mode.py)
        self.pause_state = pause.PauseState()   # a pause for new weights (atlasjax/pause.py)
        self.profiler = Profiler(profiler_dir(config.profiler_dir))   # start_profile / stop_profile (profiling.py)
        self._in_flight: LaunchedStep | None = None     # async: the step dispatched by the previous step() call

    # ---- start: load, runner, KV pool size, compiles
    def _load(self, config: EngineConfig, given) -> tuple[dict, bool]:
        """Load (or take `given`) and shard the model; the params in the engine's weight settings and whether this
        engine owns them (a tree it loaded or sharded itself goes to the runner whole)."""
        from atlasjax.model_source import (  # noqa: PLC0415
            load_for_engine, shard_loaded, with_user_settings, with_weight_settings)
        # read before the model loads: a missing or broken template fails at once
        chat_template = None if config.chat_template is None else read_chat_template(config.chat_template)
        check_host_memory(config.kv_offloading_size)
        check_directory(config.kv_offloading_disk)
        self.loaded = with_user_settings(shard_loaded(given or load_for_engine(config, self.dtype),
                                                      config.tensor_parallel_size, self.dtype), config, chat_template)
        self.model_config = cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.generation_defaults = self.loaded.generation
        self.max_model_len = resolve_max_model_len(config.max_model_len, cfg)
        if config.num_pages:
            self._check_num_pages(config.num_pages)   # before any device work
        # The runner holds the params from here on (in its execution layout: `runner.checkpoint_params()`
        # gives them back as loaded).
        params, self.loaded = self.loaded.params, dataclasses.replace(self.loaded, params=None)
        own_params = given is None or params is not given.params
        params = with_weight_settings(params, config, cfg, self.tokenizer, self.dtype, self.kv_dtype,
                                      self.max_model_len, plan=self.loaded.plan)
        self.weights_summary = weights_summary.describe(params)   # which format each weight runs in
        if config.load_format == "dummy":
            self.weights_summary += " (random: load_format dummy)"
        log.info("%s: %s", self.loaded.source, self.weights_summary)
        return params, own_params

    def _build_runner(self, config: EngineConfig, params, own_params: bool, decode_buckets) -> ModelRunner:
        # speculative decoding's draft model or EAGLE-3 head (atlasjax/draft_model.py): (config, params, plan, k)
        draft = load_speculative_draft(self.speculative, self.model_config, self.tokenizer, self.dtype,
                                       self.max_model_len, self.loaded.plan)
        spec = self.speculative
        if spec is not None and spec.ngram_on_device(config.num_scheduler_steps):
            draft = NgramDraft(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return ModelRunner(self.model_config, params, dtype=self.dtype, kv_dtype=self.kv_dtype,
                           page_size=config.page_size, max_num_seqs=self.num_slots, max_model_len=self.max_model_len,
                           prefill_buckets=config.prefill_buckets(), decode_buckets=decode_buckets,
                           attn_backend=config.attention_backend, plan=self.loaded.plan, own_params=own_params,
                           prompt_logprobs_tokens=config.prompt_logprobs_tokens,
                           long_context_split_rows=long_context_decode.resolve(
                               config.long_context_decode, on_gpu=jax.default_backend() == "gpu",
                               attention_backend=config.attention_backend, decode_buckets=decode_buckets,
                               max_model_len=self.max_model_len),
                           verify_buckets=self._verify_buckets(config), draft=draft,
                           verify_rounds=config.num_scheduler_steps if draft is not None else 1)

    def _num_pages(self, config: EngineConfig) -> int:
        """The KV pool's pages, sized from the memory left once the params (and LoRA slots) are in their execution
        layout."""
        if self.pooling_only:   # no generation: the pool holds one sequence, the memory goes to embedding batches
            num_pages = config.num_pages or -(-self.max_model_len // config.page_size)
        else:
            num_pages = distributed.broadcast_int(   # all hosts agree
                config.num_pages or auto_num_pages(config, self.model_config, self.kv_dtype, self.max_model_len,
                                                   self.runner.params, self.loaded.plan,
                                                   self.runner.draft_cfg, self.runner.draft_plan))
        self._check_num_pages(num_pages)
        return num_pages

    def _compile(self, config: EngineConfig, num_pages: int) -> None:
        """compile_at_start: every step shape (or embedding batch size) before the pool is allocated."""
        t0 = time.perf_counter()
        if self.pooling_only:
            self.embedder.warmup()
            log.info("compiled %d embedding batch sizes in %.1f s", self.embedder.num_programs,
                     time.perf_counter() - t0)
        else:
            self.runner.warmup(config.num_scheduler_steps, num_pages=num_pages)
            log.info("compiled %d step shapes and loaded %d from the program store in %.1f s",
                     self.runner.num_compiles, self.runner.num_loaded, time.perf_counter() - t0)

    def _verify_buckets(self, config: EngineConfig) -> tuple[int, ...]:
        """Token counts of the verify steps speculation can run: prefill buckets up to one that holds every slot's
        last token and drafts (within the step budget)."""
        if config.speculative_config is None:
            return ()
        most = min(self.num_slots * (1 + config.speculative_config.num_speculative_tokens),
                   config.max_num_batched_tokens)
        buckets = config.prefill_buckets()
        return tuple(b for b in buckets if b < most) + (next(b for b in buckets if b >= most),)

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

    @property
    def scheduling_policy(self) -> str:
        return self.config.scheduling_policy

    # ---- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, lora_request: LoRARequest | None = None,
                    cache_salt: str | None = None) -> list[Request]:
        """priority: with `scheduling_policy="priority"`, lower is admitted sooner and preempted later
        (any integer; 0 by default); with fcfs it must be 0, as in vLLM. arrival_time: a time.monotonic()
        reading (default: now); it orders equal priorities and starts the request's queue time.
        lora_request: run it with that LoRA adapter (an engine with enable_lora), read and checked now.
        cache_salt: vLLM's; it reuses prefix-cache pages only from requests with the same salt (None: the shared
        cache)."""
        params = params or SamplingParams()
        self.sleep_state.check_awake()
        if self.pooling_only:
            raise InvalidRequestError("this engine runs its model for embeddings only (runner='pooling'): it "
                                      "does not generate")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_priority(priority, self.config.scheduling_policy)
        adapter = self._lora_adapter(lora_request)
        check_cache_salt(cache_salt)
        token_ids = params.truncated_prompt(self.tokenize_prompt(prompt), self.max_model_len)
        vocab = self.model_config.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            if getattr(params, name) and max(getattr(params, name)) >= vocab:
                raise InvalidRequestError(f"{name} token ids must be in [0, {vocab})")
        max_tokens = self._check_length(len(token_ids), params)
        bad_seqs = bad_words.token_sequences(params.bad_words, self.tokenizer)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        seqs = []
        for i in range(params.n):
            seed = base_seed if i == 0 else hash((base_seed, i)) & 0x7FFFFFFF
            req = Request(f"{request_id}" if params.n == 1 else f"{request_id}#{i}", list(token_ids), params, seed,
                          max_tokens, self.eos_token_ids, arrival_time or time.monotonic(), priority)
            req.index, req.parent_id, req.bad_word_ids = i, request_id, bad_seqs
            req.lora_request, req.lora_adapter, req.cache_salt = lora_request, adapter, cache_salt
            self.outputs.add(req)
            seqs.append(req)
            self.scheduler.add(req)
            if self.pause_state.is_paused:
                self.scheduler.held.add(req)     # waits for resume
        self.requests[request_id] = seqs
        self.stats.num_requests += 1
        return seqs

    def _lora_adapter(self, lora_request):
        """The adapter a request names (read and checked), or None for the base model (lora_request None)."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is not enabled "
                                      "(LLM(..., enable_lora=True) / serve --enable-lora)")
        return self.lora.check(lora_request)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (text is tokenized; ids are checked against the vocabulary)."""
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

    def embed(self, prompts: list, params: PoolingParams | list[PoolingParams] | None = None
              ) -> list[tuple[list[int], np.ndarray]]:
        """(token ids embedded, float32 vector) per prompt (text or token ids), pooled as `self.pooler` says
        (atlasjax/embedding.py). Runs between steps, beside the requests in flight, without touching them."""
        result = self.embed_requests([(prompts, params)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def embed_requests(self, requests: list[tuple[list, object]], on_done: Callable | None = None) -> list:
        """Several callers' (prompts, params) in shared batches, in order: per request its `embed` result, or
        the error that refuses it (each is checked alone, so one bad request fails only itself).
        on_done(i, result): request i's result as soon as its last batch is read back (the others still run)."""
        if distributed.is_multiprocess():
            raise InvalidRequestError("embeddings run in a single-process engine, not a multi-host one")
        self.sleep_state.check_awake()
        return self.embedder.embed_requests(requests, self.tokenize_prompt, self.stats, on_done)

    @functools.cached_property
    def embedder(self):
        from atlasjax.embedding import Embedder  # noqa: PLC0415
        log.info("embeddings: %s", self.pooler.describe())
        return Embedder(self.runner, self.pooler, self.max_model_len,
                        token_budget=max(self.config.max_num_batched_tokens, 0 if jax.default_backend() != "gpu"
                                         else POOLING_TOKEN_BUDGET if self.pooling_only else EMBED_TOKEN_BUDGET),
                        classifier=self.loaded.classifier)

    @property
    def classifier_labels(self) -> tuple[str, ...]:
        """The labels of the model's classification head (a *ForSequenceClassification checkpoint), else ()."""
        return self.loaded.classifier.labels if self.loaded.classifier is not None else ()

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
            self.outputs.forget(req)
        self.stats.num_aborted += 1
        self.stats.refresh(self)
        return True

    def has_unfinished(self) -> bool:
        """Whether `step()` has work: requests to run (none while a pause is in effect) or a step to read back."""
        return self._in_flight is not None or (self.scheduler.has_work and not self.pause_state.settled)

    @property
    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def drain(self) -> list[StreamDelta]:
        """Read back the step dispatched by the last `step()` (asynchronous scheduling), if any; its deltas."""
        done, self._in_flight = self._in_flight, None
        return self._process(done) if done is not None else []

    # ---- pausing for new weights (atlasjax/pause.py, atlasjax/weight_update.py)
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> list[StreamDelta]:
        """vLLM's `pause_generation`: "abort", "wait" for or "keep" the requests in flight; later ones wait for
        `resume_generation`. Returns the deltas of the requests it ended; `pause_state.settled` says whether it
        has taken effect ("wait": once `step()` has run the requests in flight to completion)."""
        return pause.pause(self, mode, clear_cache)

    def resume_generation(self) -> None:
        pause.resume(self)

    @property
    def is_paused(self) -> bool:
        return self.pause_state.is_paused

    def update_weights_from_disk(self, model_path: str) -> dict:
        """SGLang's `update_weights_from_disk`: load a checkpoint of the same architecture in place of the weights,
        quantized and placed as they were, between steps (atlasjax/weight_update.py); what it loaded and how long
        it took."""
        from atlasjax import weight_update  # noqa: PLC0415
        return weight_update.from_disk(self, model_path)

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
        if self.pause_state.is_paused and (paused := pause.step_paused(self)) is not None:
            return paused
        t0 = time.perf_counter()
        first = []
        prev = self._in_flight
        if prev is not None and prev.spans is not None and not (
                self._pipeline_verify and prev.decode.emitted is not None
                and self.scheduler.can_pipeline_verify(prev.sched.decodes)):
            # a verify step's accepted drafts move every later position: read it back before scheduling, unless
            # the next launch is another verify-rounds launch of the same requests (it moves them on the device)
            first, self._in_flight = self._process(prev), None
        sched = self.scheduler.schedule(behind_verify=self._in_flight is not None and self._in_flight.spans is not None)
        launched = None if sched.is_empty else self.launcher.launch(sched, self._in_flight)
        if self._async_scheduling:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        if launched is None and done is None and not first:
            if self.kv_offload is not None:   # only requests whose prefix is on its way from disk: wait for it
                self.kv_offload.wait_for_reads(0.01)
            return []
        deltas = first + (self._process(done) if done is not None else [])
        self.stats.record_step(time.perf_counter() - t0, sched, self)
        return deltas

    # ---- results
    def _process(self, step: LaunchedStep) -> list[StreamDelta]:
        t0 = time.perf_counter()
        host = read_back(step, self.num_slots)
        self.stats.read_wait_seconds += time.perf_counter() - t0
        self.scheduler.completed(step.sched)
        if step.spans is not None and step.decode.emitted is not None:   # a verify-rounds launch
            self.scheduler.drafts_accepted = any(a for rounds in host.spec_rounds for _, a in rounds)
        return self.outputs.process(step, host)

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (its pages are already free)."""
        for req in self.requests.pop(request_id, []):
            self.outputs.forget(req)


"""LLMEngine: requests in, token deltas out, one `step()` at a time (single-threaded).

A step asks the scheduler for work, dispatches it (step_launch.py: packed into the fixed bucket shapes by
step_packing.py, run by the runner), reads its tokens back (step_readback.py) and turns them
into text deltas with incremental detokenization and stop checks (output_processor.py). `LLM`
drives it synchronously; `AsyncLLM` runs it in a thread. Its bases: start-up (loading, the runner, the KV pool's
size, compiles: engine_startup.py) and the requests (adding, aborting, releasing: engine_requests.py).

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

from atlasjax import distributed, hub, metrics, pause
from atlasjax.engine_config import EngineConfig, resolve_kv_cache_dtype, resolve_scheduler_steps
from atlasjax.engine_requests import EngineRequests
from atlasjax.engine_startup import EngineStartup
from atlasjax.errors import EngineConfigError, InvalidRequestError
from atlasjax.kv_offload import host_tier
from atlasjax.lora import LoRAManager
from atlasjax.output_processor import OutputProcessor
from atlasjax.outputs import StreamDelta
from atlasjax.page_pool import PagePool
from atlasjax.pooling import PoolingParams, read_pooler_config
from atlasjax.profiling import Profiler, profiler_dir
from atlasjax.request import Request
from atlasjax.scheduler import Scheduler
from atlasjax.sleep_mode import SleepState
from atlasjax.step_options import use_process_flags
from atlasjax.step_launch import StepLauncher
from atlasjax.step_readback import LaunchedStep, read_back

log = logging.getLogger("atlasjax.engine")
# tokens per embedding batch on a GPU, beside generation / on a pooling runner (elsewhere: max_num_batched_tokens;
# a larger max_num_batched_tokens raises it): 0.6B shapes on an H200 ran 291k / 315k / 305k tok/s at 8 / 16 / 32k
EMBED_TOKEN_BUDGET = 8192
POOLING_TOKEN_BUDGET = 16384


def resolve_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return jnp.dtype(name)


class LLMEngine(EngineStartup, EngineRequests):
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

    # ---- embeddings (atlasjax/embedding.py)
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

    # ---- steps in flight
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

"""Engine start-up: `EngineStartup`, a base of `LLMEngine` (atlasjax/engine.py), loads (or takes) and shards the
model, builds the runner (with speculative decoding's draft), sizes the KV pool from the device memory left, and with
compile_at_start compiles every step shape (or embedding batch size) before the pool is allocated.

`LLMEngine.__init__` calls these in that order; they set `loaded`, `model_config`, `tokenizer`, `generation_defaults`,
`max_model_len` and `weights_summary`, and read `config`, `dtype`, `kv_dtype`, `num_slots`, `speculative`,
`pooling_only`, `runner` and `embedder` as the engine has set them by then.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import jax

from atlasjax import distributed, long_context_decode, weights_summary
from atlasjax.draft_model import load_speculative_draft
from atlasjax.drafting import NgramDraft
from atlasjax.engine_config import EngineConfig, resolve_max_model_len
from atlasjax.errors import EngineConfigError
from atlasjax.kv_budget import auto_num_pages
from atlasjax.kv_disk import check_directory
from atlasjax.kv_offload import check_host_memory
from atlasjax.runner import ModelRunner
from atlasjax.tokenizer import read_chat_template

log = logging.getLogger("atlasjax.engine")


class EngineStartup:
    """Load, runner, KV pool size, compiles."""

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

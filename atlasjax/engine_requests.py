"""The engine's requests: `EngineRequests`, a base of `LLMEngine` (atlasjax/engine.py), checks a request (its
prompt tokenized and within the vocabulary and max_model_len, its priority, LoRA adapter and cache salt), makes its n
sequences and queues them with the scheduler; it aborts them, and forgets finished ones.

The engine sets `config`, `model_config`, `tokenizer`, `max_model_len`, `eos_token_ids`, `pool`, `scheduler`,
`outputs`, `lora`, `requests`, `stats`, `sleep_state`, `pause_state`, `pooling_only` and `_rng`.
"""
from __future__ import annotations

import time

from atlasjax import bad_words
from atlasjax.errors import InvalidRequestError
from atlasjax.lora import LoRARequest
from atlasjax.prompts import check_cache_salt
from atlasjax.request import Request
from atlasjax.sampling_params import SamplingParams
from atlasjax.waiting_queue import check_priority


class EngineRequests:
    """Adding, aborting and releasing requests."""

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

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (its pages are already free)."""
        for req in self.requests.pop(request_id, []):
            self.outputs.forget(req)

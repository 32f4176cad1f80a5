"""`LLM`: the offline, synchronous API (vLLM-like) over the continuous-batching engine."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import sys

import numpy as np

from atlasjax.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import InvalidRequestError
from atlasjax.generation_config import default_sampling_params
from atlasjax.lora import LoRARequest
from atlasjax.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from atlasjax.cross_encoder import is_cross_encoder, pair_ids, pair_score
from atlasjax.pooling import PoolingParams, class_probs
from atlasjax.prompts import plain_prompt, prompt_list, split_prompt
from atlasjax.sampling_params import SamplingParams


class LLM:
    """Load a model and generate from it.

    model: None (the embedded SmolLM2-135M-Instruct), a Hugging Face model directory, a .gguf
    file, or a directory saved with `LLM.save`. Other keywords are EngineConfig fields.
    """

    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over an existing engine (shares its cache, slots and compiled steps)."""
        llm = cls.__new__(cls)
        llm.engine, llm._ids = engine, itertools.count()
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def save(self, directory: str) -> None:
        """Write the loaded (possibly quantized) params + tokenizer so `LLM(directory)` loads them directly.

        Multi-host: call it on process 0 while the others `follow()`; they join the gather of the
        shards, and process 0 writes the whole checkpoint (to its own file system)."""
        from atlasjax import distributed  # noqa: PLC0415
        from atlasjax.checkpoint import save_checkpoint  # noqa: PLC0415
        engine = self.engine
        if distributed.is_multiprocess() and not distributed.is_leader():
            raise RuntimeError("LLM.save runs on process 0 of a multi-host run (the others call llm.engine.follow())")
        params = engine.runner.checkpoint_params()
        save_checkpoint(dataclasses.replace(engine.loaded, params=params), directory)

    @property
    def params(self):
        """The model's params as the engine runs them: a pytree of jax arrays in the execution layout
        (q/k/v and gate/up fused, quantized weights as their pytrees), shared with the serving steps."""
        return self.engine.runner.params

    def update_params(self, params) -> None:
        """Run the engine on new weights: `params` shaped as `LLM.params` (the same tree, shapes and dtypes:
        say, after a gradient step on them), placed where the current ones are. The compiled steps stay (the
        weights are their arguments), and the prefix cache is cleared, since its K/V came from the old
        weights. Between requests only: requests in flight would mix the two."""
        from atlasjax import weight_update  # noqa: PLC0415
        weight_update.check_can_update(self.engine, "LLM.update_params")
        weight_update.install(self.engine, params)

    def update_weights_from_disk(self, model_path: str) -> dict:
        """SGLang's `update_weights_from_disk` (vLLM's weight reload): the checkpoint at `model_path` (a Hugging
        Face directory, a .gguf file or an `LLM.save` directory of the same architecture) replaces the weights,
        quantized as the engine's own were (atlasjax/weight_update.py); the compiled steps stay. A checkpoint
        that cannot be read, or of another architecture, is refused with the reason, the old weights serving on.
        Returns {"model_path", "seconds"}."""
        return self.engine.update_weights_from_disk(model_path)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (atlasjax/sleep_mode.py), between requests: release the device memory the engine
        holds, for a trainer sharing the devices. level 1: the weights go to host memory and the KV pool is
        dropped; level 2: both dropped (give new weights with `update_params` after `wake_up`). The cached
        prompt pages are forgotten. Requests are refused until `wake_up`."""
        from atlasjax import sleep_mode  # noqa: PLC0415
        sleep_mode.sleep(self.engine, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what `sleep` released: tags among "weights" and "kv_cache" (default: both; vLLM's
        `wake_up(tags=["weights"])` then `["kv_cache"]` keeps the pool's memory free while weights load)."""
        from atlasjax import sleep_mode  # noqa: PLC0415
        sleep_mode.wake_up(self.engine, tags)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.engine.sleep_state.asleep)

    def start_profile(self, directory: str | None = None) -> str:
        """vLLM's `LLM.start_profile`: trace what the engine runs from now (atlasjax/profiling.py) into `directory`,
        by default the engine's `profiler_dir` or $ATLASJAX_PROFILER_DIR; returns the directory."""
        return self.engine.profiler.start(directory)

    def stop_profile(self) -> str:
        """End the trace and write it (`*.xplane.pb` and `perfetto_trace.json.gz`); returns its directory."""
        return self.engine.profiler.stop()

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt pages (vLLM's `LLM.reset_prefix_cache`); later prompts compute theirs again."""
        self.engine.pool.reset_prefix_cache()

    def model_fn(self, reference: bool = False, return_hidden: bool = False):
        """The model as a pure function fn(params, tokens [B, T] int32) -> logits [B, T, vocab] f32, to
        jit, differentiate or vmap (atlasjax/forward.py; `reference=True` takes the jnp attention and
        matmuls, which gradients need on a GPU). It runs on a KV pool of its own: the engine's requests
        are not touched."""
        from atlasjax.forward import model_fn  # noqa: PLC0415
        return model_fn(self.engine.runner, reference=reference, return_hidden=return_hidden)

    def forward(self, prompts, return_hidden: bool = False) -> list:
        """Logits at every position of each prompt (a string, token ids, or a list of either), in one
        batched pass: a float32 numpy array [len, vocab] per prompt, whose row i scores the token after
        the first i + 1. return_hidden: (logits, final-norm hidden states [len, embed]) per prompt.
        Compiled once per padded shape (lengths rounded up to 16)."""
        from atlasjax import distributed  # noqa: PLC0415
        from atlasjax.forward import pad_batch  # noqa: PLC0415
        if distributed.is_multiprocess():
            raise RuntimeError("LLM.forward runs in a single-process engine")
        self.engine.sleep_state.check_awake()
        prompts = _plain_prompts(prompts)
        seqs = [self.engine.tokenize_prompt(p) for p in prompts]
        logits, hidden = self._forward_jit(self.params, pad_batch(seqs, self.engine.max_model_len))
        logits = np.asarray(logits)
        if not return_hidden:
            return [logits[i, :len(s)] for i, s in enumerate(seqs)]
        hidden = np.asarray(hidden, np.float32)
        return [(logits[i, :len(s)], hidden[i, :len(s)]) for i, s in enumerate(seqs)]

    @functools.cached_property
    def _forward_jit(self):
        """`forward`'s one jitted program (hidden states always come out; only asked-for ones are copied back)."""
        import jax  # noqa: PLC0415
        return jax.jit(self.model_fn(return_hidden=True))

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, token ids, or a list of either), vLLM's `LLM.embed`: the
        model's final hidden states pooled as `llm.engine.pooler` says (last token unless the model's
        sentence-transformers config or `pooling_type` says otherwise), normalized unless asked not to.
        truncate_prompt_tokens: keep each prompt's last N tokens (shorthand for the PoolingParams field)."""
        prompts = _plain_prompts(prompts)
        if truncate_prompt_tokens is not None:
            given = pooling_params if isinstance(pooling_params, list) else [pooling_params or PoolingParams()]
            given = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in given]
            pooling_params = given if isinstance(pooling_params, list) else given[0]
        results = self.engine.embed(prompts, pooling_params)
        return [EmbeddingRequestOutput(str(next(self._ids)), ids, EmbeddingOutput(vector.tolist()))
                for ids, vector in results]

    def classify(self, prompts, truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify`, for a *ForSequenceClassification checkpoint (classifiers, reward models): the
        head over each prompt's last-token state; `outputs.probs` (softmax, or a sigmoid for one label) and
        `outputs.logits` (raw: a reward model's score). Labels: `llm.engine.classifier_labels`."""
        params = PoolingParams(task="classify", truncate_prompt_tokens=truncate_prompt_tokens)
        return [ClassificationRequestOutput(str(next(self._ids)), ids, ClassificationOutput(
                    class_probs(logits).tolist(), logits.tolist()))
                for ids, logits in self.engine.embed(_plain_prompts(prompts), params)]

    def score(self, text_1, text_2, pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: for embedding models the cosine similarity of text_1's and text_2's embeddings; for a
        cross-encoder (a classifier of one label, such as Qwen3-Reranker read through `hf_overrides`) the sigmoid
        of its head over each pair's tokens, text_1's then text_2's. One text against many (1 -> N), or pairwise
        (N -> N); each a string or token ids."""
        first, second = _plain_prompts(text_1), _plain_prompts(text_2)
        if not first or not second or len(first) not in (1, len(second)):
            raise InvalidRequestError(f"score pairs one text with many or N texts with N; got {len(first)} and "
                                      f"{len(second)}")
        if is_cross_encoder(self.engine.classifier_labels):
            engine = self.engine
            lefts = [engine.tokenize_prompt(t) for t in first] * (len(second) // len(first))
            rights = [t if isinstance(t, list) else engine.tokenizer.encode(t, add_special_tokens=False)
                      for t in second]
            pairs = [pair_ids(a, b) for a, b in zip(lefts, rights)]
            params = dataclasses.replace(pooling_params or PoolingParams(), task="classify")
            return [ScoringRequestOutput(str(next(self._ids)), ids, ScoringOutput(pair_score(logits)))
                    for ids, logits in engine.embed(pairs, params)]
        plain = dataclasses.replace(pooling_params or PoolingParams(), normalize=True)
        results = self.engine.embed(first + second, plain)
        left, right = results[:len(first)] * (len(second) // len(first)), results[len(first):]
        out = []
        for (ids_1, a), (ids_2, b) in zip(left, right):
            out.append(ScoringRequestOutput(str(next(self._ids)), ids_1 + ids_2, ScoringOutput(float(a @ b))))
        return out

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: the model's generation_config.json
        defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), else SamplingParams()'s."""
        return default_sampling_params(self.engine.generation_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, a prompt dict as vLLM's (`{"prompt": text}` or
        `{"prompt_token_ids": ids}`, with an optional `"cache_salt"`: prefix-cache pages are shared only among
        prompts of the same salt), or a list of these. One output per prompt.
        priority: one integer per prompt, with `scheduling_policy="priority"` (lower is served sooner).
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base model); the engine
        needs enable_lora=True (atlasjax/lora.py)."""
        if self.engine.is_paused:
            raise InvalidRequestError("generation is paused (engine.pause_generation): resume_generation() first")
        given = [split_prompt(p) for p in prompt_list(prompts)]
        prompts, salts = [p for p, _ in given], [salt for _, salt in given]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if isinstance(lora_request, list):
            if len(lora_request) != len(prompts):
                raise InvalidRequestError(f"got {len(lora_request)} LoRA requests for {len(prompts)} prompts")
            loras = lora_request
        else:
            loras = [lora_request] * len(prompts)
        ids = []
        try:
            for prompt, p, rank, lora, salt in zip(prompts, params, priority or [0] * len(prompts), loras, salts):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, priority=rank, lora_request=lora, cache_salt=salt)
                ids.append((rid, prompt))
        except Exception:
            for rid, _ in ids:     # a bad prompt in the batch: nothing stays queued
                self.engine.abort(rid)
            raise
        seqs = {rid: self.engine.requests[rid] for rid, _ in ids}
        done = 0
        while self.engine.has_unfinished():
            self.engine.step()
            if use_tqdm:
                now = sum(all(r.is_finished for r in s) for s in seqs.values())
                if now != done:
                    done = now
                    print(f"\rgenerate: {done}/{len(ids)} requests", end="", file=sys.stderr, flush=True)
        if use_tqdm:
            print(file=sys.stderr)
        outputs = [self._output(rid, prompt, seqs[rid]) for rid, prompt in ids]
        for rid, _ in ids:
            self.engine.release(rid)
        return outputs

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (atlasjax/beam_search.py): per prompt (a string or token ids, or a list of
        either), the params.beam_width best sequences, best first. Each round extends every prompt's live
        beams by one token in one batch through the engine (lora_request: every beam's adapter)."""
        given = [split_prompt(p) for p in prompt_list(prompts)]
        searches = [BeamSearch(self.engine.tokenize_prompt(p), params, self.engine.eos_token_ids,
                               self.engine.max_model_len) for p, _ in given]
        salt_of = {id(s): salt for s, (_, salt) in zip(searches, given)}
        step = searches[0].step_params() if searches else None
        while live := [s for s in searches if not s.done]:
            outputs = iter(self.generate([{"prompt_token_ids": beam.tokens, "cache_salt": salt_of[id(s)]}
                                          for s in live for beam in s.beams], step, lora_request=lora_request))
            for s in live:
                s.advance([next(outputs).outputs[0].logprobs[0] for _ in s.beams])
            if use_tqdm:
                print(f"\rbeam search: round {max(s.rounds for s in searches)}/{params.max_tokens}", end="",
                      file=sys.stderr, flush=True)
        if use_tqdm:
            print(file=sys.stderr)
        return [s.output(self.tokenizer) for s in searches]

    def chat(self, messages, sampling_params=None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, use_tqdm: bool = False,
             continue_final_message: bool = False, priority: list[int] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of conversations.
        continue_final_message: the model continues the last (assistant) message instead of answering it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so it cannot chat")
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {})),
            add_special_tokens=False) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request)

    def _output(self, rid, prompt, seqs) -> RequestOutput:
        first = seqs[0]
        outs = []
        for req in seqs:
            lps = req.logprobs if req.params.logprobs is not None else None
            cum = sum(d[t].logprob for d, t in zip(lps, req.output_token_ids)) if lps else None
            outs.append(CompletionOutput(req.index, req.text, list(req.output_token_ids), req.finish_reason,
                                         req.stop_reason, lps, cum))
        return RequestOutput(rid, prompt if isinstance(prompt, str) else None, list(first.prompt_token_ids), outs,
                             finished=True, num_cached_tokens=first.num_cached_tokens or 0,
                             prompt_logprobs=first.prompt_logprobs, lora_request=first.lora_request)


def _plain_prompts(prompts) -> list:
    """One prompt or a list of them (text, token ids or prompt dicts) as a list of text or token ids."""
    return [plain_prompt(p) for p in prompt_list(prompts)]

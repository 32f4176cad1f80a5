"""The runner: holds the params and the device state (KV pools, per-slot sampling state), packs each step's host
inputs into a `StepSpec` and runs its compiled program (atlasjax/steps.py); the only place (outside kernel entry
points) where `jax.jit` appears.

Steps are compiled ahead of time per shape bucket (atlasjax/step_compiler.py), so every compile is explicit, logged
and counted, and a shape outside the buckets is an error rather than a silent recompile; `warmup` compiles every
shape serving can reach (atlasjax/warmup.py) before the first request.

`ModelRunner`'s bases: the device state's shapes (atlasjax/state_shapes.py), the admit steps that reset a newly
admitted request's slot (atlasjax/admit_steps.py), and compiling and running step programs (step_compiler.py).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax import drafting, sampling, steps, verify_rounds, warmup
from atlasjax.admit_steps import AdmitSteps
from atlasjax.eagle3 import Eagle3Spec
from atlasjax.sharding import TP_AXIS
from atlasjax.state_shapes import StateShapes
from atlasjax.step_compiler import StepCompiler, StepSpec
from atlasjax.steps import DeviceState, StepOutput
from models.eagle3 import Eagle3Head
from models.fused import fuse_logical_axes, fuse_projections, unfuse_projections
from models.transformer import Transformer


class ModelRunner(StateShapes, AdmitSteps, StepCompiler):
    """Holds params and device state; compiles and runs the decode / prefill / admit steps."""

    def __init__(self, cfg, params, *, dtype, page_size: int, max_num_seqs: int, kv_dtype=None,
                 max_model_len: int, prefill_buckets: tuple[int, ...], decode_buckets: tuple[int, ...] = (),
                 attn_backend: str = "auto", plan=None, own_params: bool = False,
                 prompt_logprobs_tokens: int | None = None,
                 long_context_split_rows: dict[int, tuple[int, ...]] | None = None,
                 verify_buckets: tuple[int, ...] = (), draft=None, verify_rounds: int = 1):
        """The device state (KV pool included) comes after, from `allocate(num_pages)`: the pool is sized
        from the device memory left once the params are in their execution layout.
        decode_buckets: row counts the decode step compiles for, ascending, the last max_num_seqs
        (`EngineConfig.decode_buckets`; default: max_num_seqs alone).
        prompt_logprobs_tokens: the one token count of prefills that return prompt logprobs
        (`EngineConfig.prompt_logprobs_tokens`; default: the largest prefill bucket).
        kv_dtype: the KV pool's dtype (EngineConfig.kv_cache_dtype; default: `dtype`).
        plan: atlasjax.sharding.TensorParallel when `params` are sharded over a mesh (TP > 1).
        own_params: nobody else holds `params`; fusing projections may then free them layer by layer.
        long_context_split_rows: {decode bucket: split_rows}: the bucket also compiles (warmup) and runs a
        long-context program for each of these split_rows (atlasjax/long_context_decode.py), when `decode`
        is given it.
        verify_buckets: token counts (prefill buckets) of the speculative verify step that warmup compiles (one
        per sampling plan); () without speculative decoding.
        verify_rounds: with a draft, also compile the verify step of that many rounds per launch (verify_rounds.py).
        draft: speculative decoding's draft model (atlasjax/draft_model.py): (its config, params, plan, drafts per
        step); every step then runs it beside the target over a KV pool of its own on the same pages. Or
        `drafting.NgramDraft`: n-gram drafts looked up on the device, in a token history every step keeps."""
        self.cfg = cfg
        self.dtype = dtype
        self.kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
        self.plan = plan
        # Host inputs (one packed array per step: `pack_host`): on one device, transferred as they are
        # passed; under TP, kept on the host until `_on_mesh` sends them to every device in one batch.
        self._host = jax.device_put if plan is None else np.asarray
        # Executed with fused q/k/v and gate/up projections (models/fused.py).
        self.params = fuse_projections(params, *(() if plan is None else (plan.mesh, TP_AXIS)), in_place=own_params)
        self.page_size = page_size
        self.num_pages = 0
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.pages_per_seq = -(-max_model_len // page_size)
        self.prefill_buckets = tuple(sorted(prefill_buckets))
        self.prompt_logprobs_tokens = prompt_logprobs_tokens or self.prefill_buckets[-1]
        self.decode_buckets = tuple(decode_buckets) or (max_num_seqs,)
        self.long_context_split_rows = dict(long_context_split_rows or {})
        self.verify_buckets = tuple(verify_buckets)
        self.verify_rounds = verify_rounds
        self.model = self._executed_model(cfg, self.params, plan, attn_backend)
        self.lora_slots = None   # LoRA adapters' device slots (atlasjax/lora_slots.py), set by lora.LoRAManager
        self.draft: drafting.Draft | drafting.Eagle3Draft | drafting.NgramDraft | None = None
        self.draft_cfg = self.draft_params = self.draft_plan = None
        if isinstance(draft, drafting.NgramDraft):
            self.draft = draft
        elif draft is not None:
            self._set_draft(*draft, attn_backend=attn_backend, own_params=own_params)
        self.state: DeviceState | None = None
        self._state_shapes_now: DeviceState | None = None   # what warmup compiles against before `allocate`
        self._init_compiler()

    def _set_draft(self, cfg, params, plan, num_tokens: int, *, attn_backend: str, own_params: bool) -> None:
        """Speculative decoding's draft model (atlasjax/draft_model.py): run as the target is, fused, and under
        tensor parallelism (its `plan`, on the target's mesh) inside shard_map with its KV pool split over heads."""
        if isinstance(cfg, Eagle3Spec):   # an EAGLE-3 head (atlasjax/eagle3.py), which reads the target's layers
            self.draft_cfg = cfg.cfg
            self.draft_params = fuse_projections(params, in_place=own_params)
            head = Eagle3Head(cfg.cfg, cfg.target_hidden, cfg.draft_vocab, attn_backend, self.dtype,
                              cfg.norm_before_residual)
            if self.plan is not None:   # whole on every device of the target's mesh (it is small)
                from atlasjax.sharding import Replicated  # noqa: PLC0415
                self.draft_params = jax.device_put(self.draft_params, self.plan.replicated)
                head = Replicated(head, self.plan.mesh)
            self.draft = drafting.Eagle3Draft(head, num_tokens, "embed_tokens" in params)
            self.model = self._executed_model(self.cfg, self.params, self.plan, attn_backend, cfg.aux_layers)
            return
        if (plan is None) != (self.plan is None):
            raise ValueError("the draft model must be split over the target's mesh, or neither")
        self.draft_cfg, self.draft_plan = cfg, plan
        self.draft_params = fuse_projections(params, *(() if plan is None else (plan.mesh, TP_AXIS)),
                                             in_place=own_params)
        self.draft = drafting.Draft(self._executed_model(cfg, self.draft_params, plan, attn_backend), num_tokens,
                                 min(cfg.vocab_size, self.cfg.vocab_size))

    def _executed_model(self, cfg, fused_params, plan, attn_backend: str, aux_layers: tuple[int, ...] = ()):
        """The module the steps apply to `fused_params`: a Transformer, or under tensor parallelism (`plan`) one that
        every device runs on its shard inside shard_map (KV pools split over KV heads; host inputs and the per-slot
        sampling state replicated)."""
        if plan is None:
            return Transformer(cfg, attn_backend=attn_backend, dtype=self.dtype, aux_layers=aux_layers)
        from atlasjax.sharding import ShardedModel, logical_axes  # noqa: PLC0415
        local = Transformer(cfg, attn_backend=attn_backend, dtype=self.dtype, parallel=plan.parallel,
                            aux_layers=aux_layers)
        logical = fuse_logical_axes(logical_axes(cfg, self.dtype), fused_params)
        return ShardedModel(local, plan, plan.param_specs(fused_params, logical))

    def allocate(self, num_pages: int) -> None:
        """The device state: a KV pool of `num_pages` pages and the per-slot penalty state, zeroed (under
        TP made directly in its shardings, each device only its share)."""
        shapes = self._state_shapes(num_pages)

        def zeros():
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        self.state = zeros() if self.plan is None else jax.jit(
            zeros, out_shardings=jax.tree.map(lambda x: x.sharding, shapes))()
        self.num_pages = num_pages

    @property
    def lora(self) -> dict | None:
        """The LoRA slots' tree every step reads (atlasjax/lora_slots.py), or None without LoRA."""
        return None if self.lora_slots is None else self.lora_slots.tree

    def checkpoint_params(self) -> dict:
        """The params in checkpoint layout (per-projection, as loaded): what `LLM.save` writes."""
        if self.plan is None:
            return self.per_projection_params()
        from atlasjax.sharding import logical_axes  # noqa: PLC0415
        return self.plan.gather(self.per_projection_params(), logical_axes(self.cfg, self.dtype))

    def per_projection_params(self) -> dict:
        """The params with the fused projections split back, as loaded (still on the mesh under tensor
        parallelism)."""
        cfg, hd = self.cfg, self.cfg.head_dim
        kv = (cfg.num_kv_heads if self.plan is None else self.plan.num_kv_heads) * hd
        widths = {"qkv_proj": (cfg.num_heads * hd, kv, kv), "gate_up_proj": (cfg.intermediate_size,) * 2}
        if self.plan is None:
            return unfuse_projections(self.params, widths)
        return unfuse_projections(self.params, widths, self.plan.mesh, TP_AXIS)

    def bucket_for(self, num_tokens: int, with_prompt_logprobs: bool = False) -> int:
        """Tokens of the prefill step that runs `num_tokens`: the smallest prefill bucket that holds them,
        or with prompt logprobs always `prompt_logprobs_tokens` (one shape, compiled by the warm-up)."""
        if with_prompt_logprobs:
            if num_tokens > self.prompt_logprobs_tokens:
                raise ValueError(f"{num_tokens} tokens exceed the {self.prompt_logprobs_tokens} of a prefill with "
                                 "prompt logprobs")
            return self.prompt_logprobs_tokens
        for b in self.prefill_buckets:
            if num_tokens <= b:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest prefill bucket {self.prefill_buckets[-1]}")

    def decode_rows_for(self, num_requests: int) -> int:
        """Rows of the decode step that runs `num_requests` (the smallest decode bucket that holds them)."""
        for b in self.decode_buckets:
            if num_requests <= b:
                return b
        raise ValueError(f"{num_requests} decodes exceed the engine's {self.max_num_seqs} slots")

    # ---- steps (all asynchronous: they return device arrays). Each `_*_spec` packs the host inputs and
    # names its step (StepSpec); `_compile` compiles each key once, and warmup compiles the same specs.
    def decode_spec(self, host_inputs, prev, plan, num_steps=1, split_rows=None) -> StepSpec:
        packed, layout = steps.pack_host(host_inputs)
        args = (self.params, self.lora, self._state_arg, self._host(packed), *prev, *self._draft_args)
        rows = host_inputs[0].shape[0]
        # a long-context program (split_rows set: atlasjax/long_context_decode.py) is a step of its own name
        name, options = ("decode", {}) if split_rows is None else (f"decode_long_context_{split_rows}",
                                                                   dict(split_rows=split_rows))
        options.update(self._draft_options)
        if num_steps == 1:
            return StepSpec((name, rows, plan),
                            functools.partial(steps.decode_step, self.model, plan, layout, **options), (2,), args)
        return StepSpec((name, rows, plan, num_steps),
                        functools.partial(steps.multi_decode_step, self.model, plan, num_steps, layout, **options),
                        (2,), args)

    def prefill_spec(self, host_inputs, with_prompt_logprobs) -> StepSpec:
        packed, layout = steps.pack_host(host_inputs)
        t = host_inputs[0].shape[0]
        return StepSpec(("prefill", t, with_prompt_logprobs),
                        functools.partial(steps.prefill_step, self.model, with_prompt_logprobs, layout,
                                          **self._draft_options), (2,),
                        (self.params, self.lora, self._state_arg, self._host(packed), *self._draft_args))

    def verify_spec(self, batch: dict, f, i, prev, plan, rounds: int = 1, prev_emitted=None) -> StepSpec:
        names = steps.VERIFY_INPUTS + (verify_rounds.ROUND_INPUTS if rounds > 1 else ())
        packed, layout = steps.pack_host([batch[n] for n in names] + [f, i])
        key, step = ("verify", batch["tokens"].shape[0], plan), functools.partial(steps.verify_step, self.model, plan)
        if rounds > 1:
            key, step = key + (rounds,), functools.partial(verify_rounds.verify_rounds_step, self.model, plan, rounds)
            prev = (*prev, self.no_prev_tokens if prev_emitted is None else prev_emitted)
        return StepSpec(key, functools.partial(step, layout, **self._draft_options), (2,),
                        (self.params, self.lora, self._state_arg, self._host(packed), *prev, *self._draft_args))

    @property
    def _draft_args(self) -> tuple:
        """A step's trailing argument with a draft model or EAGLE-3 head: its params."""
        return () if self.draft_cfg is None else (self.draft_params,)

    @property
    def _draft_options(self) -> dict:
        return {} if self.draft is None else dict(draft=self.draft)

    def decode(self, tokens, page_table, seq_lens, f, i, prev_tokens=(None, None),
               plan: sampling.SamplingPlan = sampling.FULL, row_steps=None, num_steps: int = 1,
               slots=None, split_rows: float | None = None) -> StepOutput:
        """One decode over rows [R] (R a decode bucket): row r continues the request in slot slots[r]
        (default: slot r); padding rows have seq_lens 0 and slot max_num_seqs.
        prev_tokens: the previous step's gather_tokens (prefill, decode; device arrays or None) that
        negative entries of `tokens` point into (see _gather_prev).
        num_steps > 1: that many decode iterations in one launch, row r running the first row_steps[r]
        (`steps.multi_decode_step`; outputs gain a leading [num_steps] axis).
        split_rows: run that long-context program (atlasjax/long_context_decode.py; one of
        `long_context_split_rows` for this bucket)."""
        if split_rows is not None and split_rows not in self.long_context_split_rows.get(len(tokens), ()):
            raise ValueError(f"no long-context decode program with split_rows={split_rows} for {len(tokens)} rows "
                             f"(long_context_split_rows={self.long_context_split_rows}, buckets {self.decode_buckets})")
        prev = tuple(self.no_prev_tokens if t is None else t for t in prev_tokens)
        slots = np.arange(len(tokens), dtype=np.int32) if slots is None else np.asarray(slots, np.int32)
        host = (tokens, page_table, seq_lens, slots, f, i)
        if num_steps > 1:
            host += (np.asarray(row_steps, np.int32),)
        self.state, out = self._run(self.decode_spec(host, prev, plan, num_steps, split_rows))
        return out

    @functools.cached_property
    def no_prev_tokens(self):
        return self._on_mesh(jnp.zeros((self.max_num_seqs,), jnp.int32))

    def prefill(self, batch: dict, f, i, with_prompt_logprobs: bool = False) -> StepOutput:
        self.state, out = self._run(self.prefill_spec([batch[n] for n in steps.PREFILL_INPUTS] + [f, i],
                                                       with_prompt_logprobs))
        return out

    def verify(self, batch: dict, f, i, prev_tokens=(None, None),
               plan: sampling.SamplingPlan = sampling.FULL, rounds: int = 1, prev_emitted=None) -> StepOutput:
        """Speculative decoding's verify step (steps.verify_step) over a batch of `step_packing.pack_verify`:
        one sampled token per row [T]. prev_tokens: as `decode`'s (negative tokens gather from them).
        rounds > 1: that many verify rounds in one launch (atlasjax/verify_rounds.py; drafts proposed on the
        device only), outputs with a leading [rounds] axis; prev_emitted: the `emitted` of the verify launch in
        flight, which the batch's `shift_from` indexes (None: zeros)."""
        prev = tuple(self.no_prev_tokens if t is None else t for t in prev_tokens)
        self.state, out = self._run(self.verify_spec(batch, f, i, prev, plan, rounds, prev_emitted))
        return out

    def warmup(self, num_steps: int = 1, threads: int | None = None, num_pages: int | None = None,
               plans: tuple[sampling.SamplingPlan, ...] | None = None, max_decode_rows: int | None = None,
               max_prefill_tokens: int | None = None) -> None:
        """Compile every step shape serving can use (decode buckets x sampling plans, each prefill bucket,
        the one prefill with prompt logprobs, admit) without running them; with num_steps > 1 also the
        multi-step decodes. Before `allocate`, give the pool's `num_pages`: the steps then compile against
        its shapes, with the device memory the pool will take still free. `plans` and `max_decode_rows`
        narrow the decodes to those sampling plans and batch buckets; `max_prefill_tokens` narrows the
        prefills to the buckets up to it (0: none) and leaves out the prompt-logprobs prefill and admit
        (what a benchmark's greedy requests reach).

        Each step is lowered in the calling thread; the XLA compiles run in `threads` threads (outside the
        GIL). Default:
        $ATLASJAX_COMPILE_THREADS, else up to 8, or one on a GPU once the pool is allocated: each
        compile's autotuner takes device memory (~1 GB at 8B shapes) beside the pool, which leaves room
        for one. Compiles that run out of device memory in threads are compiled again one at a time."""
        before_pool = self.state is None
        if before_pool:
            if num_pages is None:
                raise ValueError("warmup before allocate() needs the pool's num_pages")
            self._state_shapes_now = self._state_shapes(num_pages)
        try:
            specs = warmup.step_specs(self, num_steps, plans or sampling.SamplingPlan.variants(),
                                      max_decode_rows or self.max_num_seqs, max_prefill_tokens)
            self.compile_specs(specs, threads or int(os.environ.get("ATLASJAX_COMPILE_THREADS", "0")) or (
                1 if jax.default_backend() == "gpu" and not before_pool else min(8, os.cpu_count() or 1)))
        finally:
            self._state_shapes_now = None

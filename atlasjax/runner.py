"""The runner: compiles the step programs (atlasjax/steps.py) per shape bucket and runs them; the only
place (outside kernel entry points) where `jax.jit` appears.

Steps are compiled ahead of time (`jit(...).lower(...).compile()`) per shape bucket, so every
compile is explicit, logged and counted, and a shape outside the buckets is an error rather than
a silent recompile. Compiled programs are kept in the program store (atlasjax/program_store.py)
when it is on, and a restart loads them instead.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import threading
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax import bad_words, program_store, sampling, steps, verify_rounds
from atlasjax.bad_words import HISTORY, MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS
from atlasjax.eagle3 import Eagle3Spec
from atlasjax.sharding import TP_AXIS
from atlasjax.sampling_params import MAX_LOGIT_BIAS
from atlasjax.step_options import step_compiler_options
from atlasjax.steps import DeviceState, StepOutput
from models.eagle3 import Eagle3Head
from models.fused import fuse_logical_axes, fuse_projections, unfuse_projections
from models.transformer import Transformer, init_kv_cache
from pallas_kernels import lowering_memo

log = logging.getLogger("atlasjax.compile")
ADMIT_ROWS = 16   # requests one admit step resets (runner.admit_rows)


def _shape_of(key: tuple) -> list:
    """A step key's shape part, as a compile log line prints it."""
    return [k if isinstance(k, (int, bool)) else str(k) for k in key[1:]]


class StepSpec(NamedTuple):
    """One step program: its compile key, the function, the donated argument positions and the arguments."""
    key: tuple
    fn: Callable
    donate: tuple[int, ...]
    args: tuple[Any, ...]


class ModelRunner:
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
        step); every step then runs it beside the target over a KV pool of its own on the same pages."""
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
        self.draft: steps.Draft | None = None
        self.draft_cfg = self.draft_params = self.draft_plan = None
        if draft is not None:
            self._set_draft(*draft, attn_backend=attn_backend, own_params=own_params)
        self.state: DeviceState | None = None
        self._state_shapes_now: DeviceState | None = None   # what warmup compiles against before `allocate`
        self.num_compiles = 0
        self.num_loaded = 0   # step programs loaded from the program store instead of compiled
        self.compile_seconds = 0.0
        self._compiled: dict = {}
        self._store_keys: dict = {}   # step key -> its program store key
        self._compile_lock = threading.Lock()   # warmup compiles in threads

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
            self.draft = steps.Eagle3Draft(head, num_tokens, "embed_tokens" in params)
            self.model = self._executed_model(self.cfg, self.params, self.plan, attn_backend, cfg.aux_layers)
            return
        if (plan is None) != (self.plan is None):
            raise ValueError("the draft model must be split over the target's mesh, or neither")
        self.draft_cfg, self.draft_plan = cfg, plan
        self.draft_params = fuse_projections(params, *(() if plan is None else (plan.mesh, TP_AXIS)),
                                             in_place=own_params)
        self.draft = steps.Draft(self._executed_model(cfg, self.draft_params, plan, attn_backend), num_tokens,
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

    def _state_shapes(self, num_pages: int) -> DeviceState:
        """What `allocate(num_pages)` makes, as shapes (with their shardings under TP): the KV pool
        split over KV heads, the per-slot state replicated. Steps compile against it before the pool
        exists."""
        cfg, plan = self.cfg, self.plan
        kv = self._kv_pool_shapes(cfg, plan, num_pages)
        draft_kv = () if self.draft is None else self._kv_pool_shapes(self.draft_cfg, self.draft_plan, num_pages)
        shape, bias = (self.max_num_seqs, cfg.vocab_size), (self.max_num_seqs, MAX_LOGIT_BIAS)
        extra = {} if plan is None else dict(sharding=plan.replicated)
        draft_hidden = ()   # an EAGLE-3 head's output at each slot's last position
        if isinstance(self.draft, steps.Eagle3Draft):   # its KV pool and outputs replicated under TP, as the head
            draft_kv = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, **extra), draft_kv)
            draft_hidden = jax.ShapeDtypeStruct((self.max_num_seqs, self.draft_cfg.hidden_size), self.dtype, **extra)
        return DeviceState(kv=kv, draft_kv=draft_kv, draft_hidden=draft_hidden,
                           counts=jax.ShapeDtypeStruct(shape, jnp.int32, **extra),
                           prompt_mask=jax.ShapeDtypeStruct(shape, jnp.bool_, **extra),
                           bias_ids=jax.ShapeDtypeStruct(bias, jnp.int32, **extra),
                           bias_vals=jax.ShapeDtypeStruct(bias, jnp.float32, **extra),
                           bad_words=jax.ShapeDtypeStruct((self.max_num_seqs, MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS),
                                                          jnp.int32, **extra),
                           recent=jax.ShapeDtypeStruct((self.max_num_seqs, HISTORY), jnp.int32, **extra))

    def _kv_pool_shapes(self, cfg, plan, num_pages: int):
        """A model's KV pool of `num_pages` pages as shapes; under tensor parallelism (`plan`) split over KV heads."""
        heads = () if plan is None else (plan.num_kv_heads,)
        kv = jax.eval_shape(functools.partial(init_kv_cache, cfg, num_pages, self.page_size, self.kv_dtype, *heads))
        if plan is None:
            return kv
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=plan.kv_sharding), kv)

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

    # ---- compilation
    def _compile(self, spec: StepSpec):
        """The compiled step of `spec`: loaded from the program store, else lowered and compiled; once per key."""
        if spec.key in self._compiled:
            return self._compiled[spec.key]
        loaded = self._load_stored(spec)
        return loaded if loaded is not None else self._compile_lowered(spec, *self._lower(spec))

    def _lower(self, spec: StepSpec):
        """(jax's Lowered of spec, the seconds lowering took)."""
        t0 = time.perf_counter()
        lowered = jax.jit(spec.fn, donate_argnums=spec.donate).lower(*self._on_mesh(spec.args))
        return lowered, time.perf_counter() - t0

    def _compile_lowered(self, spec: StepSpec, lowered, lower_seconds: float):
        t0 = time.perf_counter()
        compiled = lowered.compile(compiler_options=self._compiler_options)
        dt = time.perf_counter() - t0
        store_key = self._store_key(spec)
        stored = store_key is not None and self._program_store.save(store_key, compiled)
        with self._compile_lock:
            self.num_compiles += 1
            self.compile_seconds += lower_seconds + dt
            # One structured (JSON) line per compile, so logs can be counted and grepped.
            log.info("compile %s", json.dumps({"step": spec.key[0], "shape": _shape_of(spec.key),
                                               "seconds": round(lower_seconds + dt, 3),
                                               "lower_seconds": round(lower_seconds, 3),
                                               "num_compiles": self.num_compiles, "stored": stored}))
            return self._register(spec.key, compiled)

    def _load_stored(self, spec: StepSpec):
        """The compiled step of `spec` from the program store (atlasjax/program_store.py), or None."""
        store_key = self._store_key(spec)
        if store_key is None:
            return None
        t0 = time.perf_counter()
        compiled = self._program_store.load(store_key, self._execution_devices)
        if compiled is None:
            return None
        with self._compile_lock:
            self.num_loaded += 1
            log.info("load %s", json.dumps({"step": spec.key[0], "shape": _shape_of(spec.key),
                                            "seconds": round(time.perf_counter() - t0, 3)}))
            return self._register(spec.key, compiled)

    def _is_stored(self, spec: StepSpec) -> bool:
        store_key = self._store_key(spec)
        return store_key is not None and self._program_store.has(store_key)

    def _register(self, key, compiled):
        if self.plan is not None:
            compiled = functools.partial(self._call_on_mesh, compiled)
        return self._compiled.setdefault(key, compiled)

    @functools.cached_property
    def _program_store(self):   # asked first in the calling thread (warmup), before any compile thread
        return program_store.from_jax_config()

    def _store_key(self, spec: StepSpec) -> str | None:
        """spec's key in the program store, made once per step (it flattens the params); None without a
        store (or a key)."""
        if self._program_store is None:
            return None
        if spec.key not in self._store_keys:
            # host inputs keyed as they are (under TP `_on_mesh` replicates them, the same way every time)
            self._store_keys[spec.key] = self._program_store.key(spec.key, spec.fn, spec.donate, spec.args,
                                                                 self._compiler_options)
        return self._store_keys[spec.key]

    @functools.cached_property
    def _execution_devices(self) -> list:
        """The devices a step program runs on, in the order it was compiled for."""
        if self.plan is not None:
            return list(self.plan.mesh.devices.flat)
        leaf = jax.tree.leaves(self.params)[0]
        return sorted(leaf.sharding.device_set, key=lambda d: d.id)

    def _on_mesh(self, tree):
        """Tensor parallel: host inputs (and arrays on one device) become replicated over the mesh;
        params and device state keep their shardings. Identity on one device."""
        if self.plan is None:
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        host = [i for i, x in enumerate(leaves) if not isinstance(x, jax.ShapeDtypeStruct)
                and not (isinstance(x, jax.Array) and x.sharding.device_set == self._mesh_devices)]
        for i, x in zip(host, jax.device_put([leaves[i] for i in host], self.plan.replicated)):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    @functools.cached_property
    def _compiler_options(self) -> dict:
        if self.plan is None:
            return step_compiler_options(jax.devices()[0].platform, 1)
        mesh = self.plan.mesh.devices
        return step_compiler_options(mesh.flat[0].platform, mesh.size)

    @functools.cached_property
    def _mesh_devices(self):
        return set(self.plan.mesh.devices.flat)

    def _call_on_mesh(self, compiled, *args):
        # params and device state are on the mesh already (and large): only the host inputs move
        return compiled(*(a if a is self.params or a is self.state else self._on_mesh(a) for a in args))

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
    def _decode_spec(self, host_inputs, prev, plan, num_steps=1, split_rows=None) -> StepSpec:
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

    def _prefill_spec(self, host_inputs, with_prompt_logprobs) -> StepSpec:
        packed, layout = steps.pack_host(host_inputs)
        t = host_inputs[0].shape[0]
        return StepSpec(("prefill", t, with_prompt_logprobs),
                        functools.partial(steps.prefill_step, self.model, with_prompt_logprobs, layout,
                                          **self._draft_options), (2,),
                        (self.params, self.lora, self._state_arg, self._host(packed), *self._draft_args))

    def _verify_spec(self, batch: dict, f, i, prev, plan, rounds: int = 1) -> StepSpec:
        names = steps.VERIFY_INPUTS + (verify_rounds.ROUND_INPUTS if rounds > 1 else ())
        packed, layout = steps.pack_host([batch[n] for n in names] + [f, i])
        key, step = ("verify", batch["tokens"].shape[0], plan), functools.partial(steps.verify_step, self.model, plan)
        if rounds > 1:
            key, step = key + (rounds,), functools.partial(verify_rounds.verify_rounds_step, self.model, plan, rounds)
        return StepSpec(key, functools.partial(step, layout, **self._draft_options), (2,),
                        (self.params, self.lora, self._state_arg, self._host(packed), *prev, *self._draft_args))

    @property
    def _draft_args(self) -> tuple:
        """A step's trailing argument with a draft model: its params (steps.Draft)."""
        return () if self.draft is None else (self.draft_params,)

    @property
    def _draft_options(self) -> dict:
        return {} if self.draft is None else dict(draft=self.draft)

    @property
    def admit_rows(self) -> int:
        """Requests one admit step takes (more admitted in one engine step run more admit steps)."""
        return min(self.max_num_seqs, ADMIT_ROWS)

    def _admit_spec(self, group) -> StepSpec:
        """group: (slot, token ids, prompt_len, bias table, bad-word sequences) of up to `admit_rows` requests,
        distinct slots, max_model_len tokens in all (`admit` packs them so)."""
        rows = self.admit_rows
        slots = np.full(rows, self.max_num_seqs, np.int32)
        starts = np.zeros(rows + 1, np.int32)
        prompt_lens = np.zeros(rows, np.int32)
        tokens = np.zeros(self.max_model_len, np.int32)
        bias_ids = np.zeros((rows, MAX_LOGIT_BIAS), np.int32)
        bias_vals = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
        bad = np.full((rows, MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS), -1, np.int32)
        for r, (slot, token_ids, prompt_len, bias, bad_seqs) in enumerate(group):
            slots[r], prompt_lens[r] = slot, prompt_len
            starts[r + 1] = starts[r] + len(token_ids)
            tokens[starts[r]:starts[r + 1]] = token_ids
            bias_ids[r], bias_vals[r] = sampling.logit_bias_row(bias)
            bad[r] = bad_words.table(bad_seqs)
        starts[len(group) + 1:] = starts[len(group)]   # padding rows: empty
        packed, layout = steps.pack_host((slots, starts, prompt_lens, tokens, bias_ids, bias_vals, bad))
        return StepSpec(("admit", self.max_model_len, rows), functools.partial(steps.admit_step, layout), (0,),
                        (self._state_arg, self._host(packed)))

    def _run(self, spec: StepSpec):
        return self._compile(spec)(*spec.args)

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
        prev = tuple(self._no_prev_tokens if t is None else t for t in prev_tokens)
        slots = np.arange(len(tokens), dtype=np.int32) if slots is None else np.asarray(slots, np.int32)
        host = (tokens, page_table, seq_lens, slots, f, i)
        if num_steps > 1:
            host += (np.asarray(row_steps, np.int32),)
        self.state, out = self._run(self._decode_spec(host, prev, plan, num_steps, split_rows))
        return out

    @functools.cached_property
    def _no_prev_tokens(self):
        return self._on_mesh(jnp.zeros((self.max_num_seqs,), jnp.int32))

    def prefill(self, batch: dict, f, i, with_prompt_logprobs: bool = False) -> StepOutput:
        self.state, out = self._run(self._prefill_spec([batch[n] for n in steps.PREFILL_INPUTS] + [f, i],
                                                       with_prompt_logprobs))
        return out

    def verify(self, batch: dict, f, i, prev_tokens=(None, None),
               plan: sampling.SamplingPlan = sampling.FULL, rounds: int = 1) -> StepOutput:
        """Speculative decoding's verify step (steps.verify_step) over a batch of `step_packing.pack_verify`:
        one sampled token per row [T]. prev_tokens: as `decode`'s (negative tokens gather from them).
        rounds > 1: that many verify rounds in one launch (atlasjax/verify_rounds.py; drafts proposed on the
        device only), outputs with a leading [rounds] axis."""
        prev = tuple(self._no_prev_tokens if t is None else t for t in prev_tokens)
        self.state, out = self._run(self._verify_spec(batch, f, i, prev, plan, rounds))
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
            self._warmup(num_steps, threads or int(os.environ.get("ATLASJAX_COMPILE_THREADS", "0")) or (
                1 if jax.default_backend() == "gpu" and not before_pool else min(8, os.cpu_count() or 1)),
                plans or sampling.SamplingPlan.variants(), max_decode_rows or self.max_num_seqs, max_prefill_tokens)
        finally:
            self._state_shapes_now = None

    @property
    def _state_arg(self):
        """The device state a step is called (or, before `allocate`, compiled) with."""
        return self._state_shapes_now if self.state is None else self.state

    def _warmup(self, num_steps: int, threads: int, plans, max_decode_rows: int, max_prefill_tokens: int | None) -> None:
        s, p = self.max_num_seqs, self.pages_per_seq
        z = functools.partial(np.zeros, dtype=np.int32)
        specs = []
        for rows in (b for b in self.decode_buckets if b <= max_decode_rows):
            f, i = sampling.pack_rows([], rows)
            host = (z(rows), z((rows, p)), z(rows), z(rows), f, i)
            variants = (None, *self.long_context_split_rows.get(rows, ()))
            for plan in plans:
                for split_rows in variants:
                    specs.append(self._decode_spec(host, (self._no_prev_tokens,) * 2, plan, 1, split_rows))
                    if num_steps > 1:
                        specs.append(self._decode_spec(host + (z(rows),), (self._no_prev_tokens,) * 2, plan, num_steps,
                                                       split_rows))
        f, i = sampling.pack_rows([], s)
        serving = max_prefill_tokens is None
        prefills = [(t, False) for t in self.prefill_buckets if serving or t <= max_prefill_tokens]
        prefills += [(self.prompt_logprobs_tokens, True)] if serving else []
        def ragged(t):   # a packed-chunks step's attention inputs, empty
            return dict(tokens=z(t), positions=z(t), slot_mapping=z(t), page_table=z((s, p)), seq_lens=z(s),
                        query_start=z(s + 1), num_seqs=np.int32(0))
        for t, with_prompt_logprobs in prefills:
            batch = dict(ragged(t), sample_rows=z(s), slot_ids=z(s), commit=np.zeros(s, bool), next_tokens=z(t))
            specs.append(self._prefill_spec([batch[n] for n in steps.PREFILL_INPUTS] + [f, i], with_prompt_logprobs))
        if serving:
            specs.append(self._admit_spec([]))
        for t in self.verify_buckets if serving else ():
            f, i = sampling.pack_rows([], t)
            batch = dict(ragged(t), row_slots=z(t), budgets=z(s), caps=z(s))
            specs += [self._verify_spec(batch, f, i, (self._no_prev_tokens,) * 2, plan, rounds) for plan in plans
                      for rounds in dict.fromkeys((1, self.verify_rounds))]
        specs = [spec for spec in specs if spec.key not in self._compiled]
        t0 = time.perf_counter()
        _ = self._program_store, self._execution_devices   # made here, not raced for in the threads
        stored = [spec for spec in specs if self._is_stored(spec)]
        stored_keys = {spec.key for spec in stored}
        # What the store lacks compiles first: an XLA CPU executable compiled after this process loaded
        # others can come back incomplete from the store (program_store.ProgramStore.save).
        jobs = self._compile_all([spec for spec in specs if spec.key not in stored_keys], threads)
        # Stored programs load in threads (0.5-1.2 s each at 8B shapes on an H100, mostly outside the GIL).
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="atlasjax-compile") as pool:
            loaded = [spec for spec, found in zip(stored, pool.map(self._load_stored, stored)) if found is not None]
        jobs += self._compile_all([spec for spec in stored if spec.key not in self._compiled], threads)   # unreadable
        log.info("warmup %s", json.dumps({"programs": len(jobs) + len(loaded), "loaded": len(loaded),
                                          "seconds": round(time.perf_counter() - t0, 2),
                                          "lower_seconds": round(sum(lowered[1] for _, lowered in jobs), 2),
                                          "kernel_lowering_memo": lowering_memo.stats()}))

    def _compile_all(self, specs: list[StepSpec], threads: int) -> list:
        """Lower each of `specs` here, one at a time, and compile them in `threads` threads (outside the
        GIL): programs lowered in concurrent threads came out different from one start to the next on a
        GPU (session 43), so a restart missed every entry of the compilation cache. Returns each spec with
        its (Lowered, lowering seconds)."""
        jobs = []
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="atlasjax-compile") as pool:
            for spec in specs:
                lowered = self._lower(spec)
                jobs.append((spec, lowered, pool.submit(self._compile_lowered, spec, *lowered)))
        retry = []
        for spec, lowered, done in jobs:
            error = done.exception()
            if error is None:
                continue
            if threads == 1 or "RESOURCE_EXHAUSTED" not in str(error):
                raise error
            retry.append((spec, lowered))   # concurrent autotuners ran out of device memory: again, one at a time
        if retry:
            log.warning("warmup: %d of %d compiles ran out of device memory in %d threads; compiling them one "
                        "at a time", len(retry), len(jobs), threads)
        for spec, lowered in retry:
            self._compile_lowered(spec, *lowered)
        return [(spec, lowered) for spec, lowered, _ in jobs]

    def admit(self, requests) -> None:
        """Reset the sampling state of each request's slot: requests, (slot, token ids so far, prompt_len,
        SamplingParams.bias_table(), bad-word token sequences) each (the first prompt_len tokens its prompt; a
        request's tokens past max_model_len are left out). They run in as few admit steps as hold them: up to
        `admit_rows` requests and max_model_len tokens each, in order (a slot named twice starts a new step, so
        the later one wins)."""
        group, used = [], 0
        for slot, token_ids, prompt_len, bias, bad_seqs in requests:
            token_ids = token_ids[:self.max_model_len]
            if group and (len(group) == self.admit_rows or used + len(token_ids) > self.max_model_len
                          or any(slot == g[0] for g in group)):
                self.state = self._run(self._admit_spec(group))
                group, used = [], 0
            group.append((slot, token_ids, prompt_len, bias, bad_seqs))
            used += len(token_ids)
        if group:
            self.state = self._run(self._admit_spec(group))

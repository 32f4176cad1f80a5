"""The shapes of the runner's device state (steps.DeviceState): the KV pool (and a draft model's or EAGLE-3 head's),
the per-slot sampling state and the n-gram token history, with their shardings under tensor parallelism (KV pools
split over KV heads, the rest replicated). `ModelRunner.allocate` makes the state from them; before it, warmup
compiles the steps against them while the pool's device memory is still free.

`StateShapes` is a base of `ModelRunner` (atlasjax/runner.py), which sets `cfg`, `plan`, `dtype`, `kv_dtype`,
`page_size`, `max_num_seqs`, `max_model_len`, the draft's `draft`, `draft_cfg` and `draft_plan`, `state` and
`_state_shapes_now`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from atlasjax import drafting
from atlasjax.bad_words import HISTORY, MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS
from atlasjax.sampling_params import MAX_LOGIT_BIAS
from atlasjax.steps import DeviceState
from models.transformer import init_kv_cache


class StateShapes:
    """The device state as shapes, for a pool of `num_pages` pages, and the state (or shapes) steps are given."""

    def _state_shapes(self, num_pages: int) -> DeviceState:
        """What `allocate(num_pages)` makes, as shapes (with their shardings under TP): the KV pool
        split over KV heads, the per-slot state replicated. Steps compile against it before the pool
        exists."""
        cfg, plan = self.cfg, self.plan
        kv = self._kv_pool_shapes(cfg, plan, num_pages)
        draft_kv = () if self.draft_cfg is None else self._kv_pool_shapes(self.draft_cfg, self.draft_plan, num_pages)
        shape, bias = (self.max_num_seqs, cfg.vocab_size), (self.max_num_seqs, MAX_LOGIT_BIAS)
        extra = {} if plan is None else dict(sharding=plan.replicated)
        draft_hidden = ()   # an EAGLE-3 head's output at each slot's last position
        if isinstance(self.draft, drafting.Eagle3Draft):   # its KV pool and outputs replicated under TP, as the head
            draft_kv = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, **extra), draft_kv)
            draft_hidden = jax.ShapeDtypeStruct((self.max_num_seqs, self.draft_cfg.hidden_size), self.dtype, **extra)
        history = ()   # each slot's tokens, which n-gram drafts on the device look up
        if isinstance(self.draft, drafting.NgramDraft):
            history = jax.ShapeDtypeStruct((self.max_num_seqs, self.max_model_len), jnp.int32, **extra)
        return DeviceState(kv=kv, draft_kv=draft_kv, draft_hidden=draft_hidden, history=history,
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
    def _state_arg(self):
        """The device state a step is called (or, before `allocate`, compiled) with."""
        return self._state_shapes_now if self.state is None else self.state

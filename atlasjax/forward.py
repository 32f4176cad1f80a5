"""Whole sequences through the engine's model in one pass: logits (and final hidden states) as a pure
function of the params, for research (scoring, probing, gradients) beside the serving steps.

    fn = model_fn(llm.engine.runner)
    logits = jax.jit(fn)(llm.params, tokens)        # tokens [B, T] int32 -> [B, T, vocab] float32
    grads = jax.grad(lambda p: loss(fn(p, tokens)))(llm.params)

Each call runs the model on a KV pool of its own, made inside the function and sized for the batch (the
engine's pool and slots are not touched), as one ragged prefill of B sequences of T tokens: the same
model code, attention and matmul dispatch the engine's prefill runs. Causal attention keeps a row blind
to the rows after it, so shorter sequences padded at the end read correctly up to their length.
"""
from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np

from atlasjax.errors import InvalidRequestError
from models.attention import AttentionMetadata
from models.reference import reference_kernels
from models.transformer import Transformer, init_kv_cache


def model_fn(runner, *, reference: bool = False, return_hidden: bool = False):
    """fn(params, tokens [B, T] int32) -> logits [B, T, vocab] f32 (and hidden [B, T, embed] after the
    final norm, with return_hidden). params: the runner's (`LLM.params`: the execution layout, q/k/v and
    gate/up fused). reference: trace the jnp attention and matmuls even on a GPU (`models/reference.py`):
    what gradients need there, since the Pallas kernels have no VJP; elsewhere they run anyway."""
    model, cfg, page_size, kv_dtype, plan = runner.model, runner.cfg, runner.page_size, runner.kv_dtype, runner.plan
    kv_heads = () if plan is None else (plan.num_kv_heads,)

    def fn(params, tokens):
        with reference_kernels() if reference else contextlib.nullcontext():
            return _forward(params, tokens)

    def _forward(params, tokens):
        batch, length = tokens.shape
        pages = -(-length // page_size)
        kv = init_kv_cache(cfg, batch * pages, page_size, kv_dtype, *kv_heads)
        positions = jnp.arange(length, dtype=jnp.int32)
        page_table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
        slot_mapping = page_table[:, positions // page_size] * page_size + positions % page_size
        meta = AttentionMetadata(slot_mapping=slot_mapping.reshape(-1), page_table=page_table,
                                 seq_lens=jnp.full((batch,), length, jnp.int32),
                                 query_start=jnp.arange(batch + 1, dtype=jnp.int32) * length,
                                 num_seqs=jnp.int32(batch))
        flat = tokens.reshape(-1).astype(jnp.int32)
        hidden, _ = model.apply({"params": params}, flat, jnp.tile(positions, batch), kv, meta)
        logits = model.apply({"params": params}, hidden, method=Transformer.logits).reshape(batch, length, -1)
        return (logits, hidden.reshape(batch, length, -1)) if return_hidden else logits
    return fn


def pad_batch(sequences: list[list[int]], max_len: int, multiple: int = 16) -> np.ndarray:
    """Token id lists (each already checked as a prompt: `LLMEngine.tokenize_prompt`) -> [B, T] int32, T the
    longest rounded up to `multiple` (few shapes to compile), padded at the end with token 0. No
    sequences, or one over max_len, is refused."""
    if not sequences:
        raise InvalidRequestError("forward needs at least one sequence")
    longest = max(len(s) for s in sequences)
    if longest > max_len:
        raise InvalidRequestError(f"a sequence has {longest} tokens, more than max_model_len={max_len}")
    out = np.zeros((len(sequences), min(-(-longest // multiple) * multiple, max_len)), np.int32)
    for row, s in zip(out, sequences):
        row[:len(s)] = s
    return out

"""Row bookkeeping the step programs share: a step's rows against engine slots and requests, and the
token history n-gram drafts look up (DeviceState.history, atlasjax/steps.py)."""
from __future__ import annotations

import jax.numpy as jnp


def slot_rows(state_rows, slots):
    """Per-slot state [max_num_seqs, ...] at a step's rows (padding rows, slot max_num_seqs: the last slot's)."""
    return state_rows[jnp.minimum(slots, state_rows.shape[0] - 1)]


def token_sequences(query_start, num_tokens: int):
    """[num_tokens] the sequence each row of chunks laid end to end belongs to (query_start's length - 1 past the
    last chunk); one compare of [num_tokens, sequences], no loop."""
    return jnp.searchsorted(query_start[1:], jnp.arange(num_tokens), side="right", method="compare_all")


def record_tokens(history, slots, positions, tokens):
    """The token history (DeviceState.history) with each row's token at its slot and position (a slot out of range:
    dropped); unchanged without one."""
    if isinstance(history, tuple):
        return history
    return history.at[slots, positions].set(tokens, mode="drop")

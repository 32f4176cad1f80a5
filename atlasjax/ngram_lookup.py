"""n-gram (prompt lookup) drafts proposed on the device, inside a verify-rounds launch (atlasjax/verify_rounds.py), by
the rule `speculative.propose` applies on the host: the longest suffix n-gram (prompt_lookup_max down to
prompt_lookup_min) that occurs earlier in the request's tokens; its latest occurrence with `room` tokens after it,
else its earliest; the tokens after it, at most `room`.

The tokens come from the device's token history (`DeviceState.history`: each slot's tokens by position, written by
the admit step and by every step that runs a token), so a launch's later rounds look up the tokens its earlier rounds
accepted, and a launch scheduled behind another (pipelined) those the other emitted, none of which the host has yet.
One pass of compares over the history per n: [requests, max_model_len] each.
"""
from __future__ import annotations

import jax.numpy as jnp


def propose(history, last, room, num_tokens: int, min_n: int, max_n: int):
    """history [n, L]: each request's tokens by position, valid up to `last` [n] (its newest token's position);
    room [n]: the drafts it may take (at most num_tokens). -> (drafts [n, num_tokens], 0 past `count`; count [n])."""
    n, length = history.shape
    room = jnp.maximum(room, 0)
    rows, at = jnp.arange(n), jnp.arange(length)[None, :]
    last = last[:, None]
    # ends[e]: an occurrence of the suffix n-gram ends at position e < last (n = 1 here)
    ends = (at < last) & (history == history[rows, last[:, 0]][:, None])
    found = ends if min_n <= 1 else jnp.zeros_like(ends)
    for m in range(2, max_n + 1):   # each n-gram's ends lie among the (n - 1)-gram's
        back = jnp.pad(history, ((0, 0), (m - 1, 0)), constant_values=-1)[:, :length]   # back[e] = history[e - m + 1]
        ends = ends & (back == history[rows, jnp.maximum(last[:, 0] - m + 1, 0)][:, None])
        if m >= min_n:
            found = jnp.where(ends.any(axis=1, keepdims=True), ends, found)   # the longest n that occurs wins
    full = found & (at + room[:, None] <= last)     # room tokens follow it before the newest token
    latest_full = jnp.max(jnp.where(full, at, -1), axis=1)
    earliest = jnp.min(jnp.where(found, at, length), axis=1)
    start = jnp.where(latest_full >= 0, latest_full, earliest) + 1
    count = jnp.where(found.any(axis=1), jnp.clip(last[:, 0] + 1 - start, 0, room), 0)
    j = jnp.arange(num_tokens)[None, :]
    drafts = history[rows[:, None], jnp.minimum(start[:, None] + j, length - 1)]
    return jnp.where(j < count[:, None], drafts, 0), count

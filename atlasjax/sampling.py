"""On-device sampling for a batch of rows, each with its own parameters (runs inside the jitted steps).

Order per row: raw logprobs (reported) -> repetition / frequency / presence penalties ->
min_tokens masking of stop ids -> greedy argmax, or temperature, top-k / top-p / min-p
filtering and a seeded Gumbel-max draw. The sort needed by the filters runs only when some row
uses one (lax.cond), and top-k logprobs only when some row asks for them.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.sampling_params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams

# column layout of the packed per-row parameter arrays (one host->device transfer each)
F_TEMP, F_TOP_P, F_MIN_P, F_PRES, F_FREQ, F_REP = range(6)
I_TOP_K, I_SEED, I_STEP, I_LOGPROBS, I_MIN_TOKENS = range(5)
NUM_F, NUM_I = 6, 5 + MAX_STOP_TOKEN_IDS


@flax.struct.dataclass
class SamplingTensors:
    floats: jax.Array   # [rows, NUM_F] f32
    ints: jax.Array     # [rows, NUM_I] int32 (stop ids from column 5, -1 padded)


def pack_rows(rows: list[tuple[SamplingParams, int, int, tuple[int, ...]] | None], num_rows: int):
    """Host side: (params, seed, num_generated, eos_ids) per row (None = padding) -> numpy arrays."""
    f = np.zeros((num_rows, NUM_F), np.float32)
    i = np.zeros((num_rows, NUM_I), np.int32)
    f[:, F_TOP_P] = 1.0
    f[:, F_REP] = 1.0
    i[:, 5:] = -1
    for r, row in enumerate(rows):
        if row is None:
            continue
        p, seed, step, eos = row
        f[r] = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        stops = ([] if p.ignore_eos else list(eos)) + list(p.stop_token_ids)
        i[r, :5] = (p.top_k, seed & 0x7FFFFFFF, step, p.logprobs or 0, p.min_tokens)
        stops = stops[:MAX_STOP_TOKEN_IDS]
        i[r, 5:5 + len(stops)] = stops
    return f, i


def apply_penalties(logits, counts, prompt_mask, f):
    """logits [rows, vocab] f32; counts [rows, vocab] int32 (generated); prompt_mask [rows, vocab] bool."""
    rep = f[:, F_REP:F_REP + 1]
    seen = (counts > 0) | prompt_mask
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - f[:, F_FREQ:F_FREQ + 1] * counts.astype(jnp.float32)
    return logits - f[:, F_PRES:F_PRES + 1] * (counts > 0).astype(jnp.float32)


def _filter(logits, f, i):
    """top-k / top-p / min-p on temperature-scaled logits (needs one descending sort)."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(i[:, I_TOP_K] > 0, jnp.minimum(i[:, I_TOP_K], vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = cum_before < f[:, F_TOP_P:F_TOP_P + 1]
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    min_logit = sorted_desc[:, :1] + jnp.log(jnp.maximum(f[:, F_MIN_P:F_MIN_P + 1], 1e-30))
    threshold = jnp.maximum(jnp.maximum(kth, pth), jnp.where(f[:, F_MIN_P:F_MIN_P + 1] > 0, min_logit, -jnp.inf))
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _top_logprobs(logprobs):
    vals, ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return vals, ids.astype(jnp.int32)


def sample(logits, counts, prompt_mask, st: SamplingTensors):
    """logits: [rows, vocab] f32 -> (tokens [rows], chosen logprob [rows], top vals/ids [rows, K])."""
    f, i = st.floats, st.ints
    rows, vocab = logits.shape
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = apply_penalties(logits, counts, prompt_mask, f)
    # min_tokens: stop ids may not be chosen yet
    stop_ids = i[:, 5:]
    block = (i[:, I_STEP] < i[:, I_MIN_TOKENS])[:, None] & (stop_ids >= 0)
    blocked = jnp.zeros((rows, vocab), bool).at[jnp.arange(rows)[:, None], jnp.maximum(stop_ids, 0)].max(block)
    logits = jnp.where(blocked, -jnp.inf, logits)
    greedy = jnp.argmax(logits, axis=-1)
    temp = f[:, F_TEMP:F_TEMP + 1]
    scaled = logits / jnp.where(temp > 0, temp, 1.0)
    needs_filter = jnp.any((i[:, I_TOP_K] > 0) | (f[:, F_TOP_P] < 1.0) | (f[:, F_MIN_P] > 0))
    scaled = jax.lax.cond(needs_filter, lambda s: _filter(s, f, i), lambda s: s, scaled)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(i[:, I_SEED], i[:, I_STEP])
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
    sampled = jnp.argmax(scaled + gumbel, axis=-1)
    tokens = jnp.where(f[:, F_TEMP] > 0, sampled, greedy).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.cond(
        jnp.any(i[:, I_LOGPROBS] > 0), _top_logprobs,
        lambda lp: (jnp.zeros((rows, MAX_LOGPROBS), jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32)),
        logprobs)
    return tokens, chosen, top_vals, top_ids


def prompt_logprobs(logits, next_tokens):
    """logits [tokens, vocab] f32, next_tokens [tokens] -> logprob of each next token + top-K."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_tokens, 0)[:, None], axis=-1)[:, 0]
    vals, ids = _top_logprobs(logprobs)
    return chosen, vals, ids

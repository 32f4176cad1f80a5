"""On-device sampling for a batch of rows, each with its own parameters (runs inside the jitted steps).

Order per row: raw logprobs (reported) -> repetition / frequency / presence penalties -> logit
bias -> allowed_token_ids masking -> bad_words masking -> min_tokens masking of stop ids -> greedy argmax, or
temperature, top-k / top-p / min-p filtering and a seeded Gumbel-max draw.

There is no data-dependent branch (a `lax.cond` makes the GPU runtime copy its predicate to the
host and wait, which stalls dispatch). Instead the host picks a static `SamplingPlan` per step
from its rows: the common all-greedy step is a bare argmax; anything else runs every stage. Either
computes the reported logprobs (log-softmax, the chosen token's and the top MAX_LOGPROBS) only when
some row asked for them: 89 us of an 8-row step over a 128k vocabulary on an H200, 234 us of a
32-row one (session 63).
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams

# column layout of the packed per-row parameter arrays (one host->device transfer each)
F_TEMP, F_TOP_P, F_MIN_P, F_PRES, F_FREQ, F_REP, F_ONLY_LISTED = range(7)
I_TOP_K, I_SEED, I_STEP, I_LOGPROBS, I_MIN_TOKENS = range(5)
NUM_F, NUM_I = 7, 5 + MAX_STOP_TOKEN_IDS
TOP_K_CHUNK = 1024     # _top_k's chunk: the fastest for 1-8 rows of 128k on an H200 (notebooks/gpu_sampling_sorts.py)
BIAS_PAD = 2**31 - 1   # the bias table's padding id: past any vocabulary, so it adds nothing and allows nothing


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """What a step's sampling must compute (static: one compiled variant per plan)."""
    greedy: bool = False     # every row greedy, no penalties, no min_tokens blocking: argmax only
    logprobs: bool = True    # some row wants logprobs (chosen token's and top-K)

    @staticmethod
    def variants() -> tuple[SamplingPlan, ...]:
        return (SamplingPlan(True, False), SamplingPlan(True, True), SamplingPlan(False, False), FULL)


FULL = SamplingPlan(False, True)


def plan_rows(rows: list[tuple[SamplingParams, int, int, tuple[int, ...]] | None]) -> SamplingPlan:
    """Host side: the cheapest plan that serves every row exactly."""
    greedy, logprobs = True, False
    for row in rows:
        if row is None:
            continue
        p, _, step, _ = row
        logprobs |= p.logprobs is not None
        greedy &= (p.temperature == 0 and p.repetition_penalty == 1.0 and p.frequency_penalty == 0
                   and p.presence_penalty == 0 and step >= p.min_tokens and not p.logit_bias
                   and p.allowed_token_ids is None and not p.bad_words)
    return SamplingPlan(greedy, logprobs)


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
        f[r] = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                float(p.allowed_token_ids is not None))
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


def _order_key(x):
    """f32 -> uint32 whose unsigned order is the floats' order (NaN aside)."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _from_order_key(k):
    u = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def _sort_desc(x):
    """Each row of f32 `x` sorted in descending order, exactly. XLA sorts unsigned keys faster than floats
    (whose comparator orders NaNs): 0.55 against 0.91 ms for [32, 128256] on an H200 (session 63)."""
    return _from_order_key(jnp.sort(_order_key(x), axis=-1))[..., ::-1]


def _top_k(x, k: int):
    """lax.top_k(x, k) over the last axis, exactly (values and ids), as the top k of each chunk of
    TOP_K_CHUNK and then of the chunk winners: one top_k over a 128k vocabulary is a full sort in XLA,
    0.97 ms for 32 rows on an H200 against 0.25 chunked, and 93 against 49 us for one row (session 63)."""
    *lead, n = x.shape
    chunk = min(TOP_K_CHUNK, n)
    num_chunks = -(-n // chunk)
    if num_chunks == 1:
        return jax.lax.top_k(x, k)
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, num_chunks * chunk - n)], constant_values=-jnp.inf)
    vals, ids = jax.lax.top_k(padded.reshape(*lead, num_chunks, chunk), k)
    ids = ids + jnp.arange(num_chunks, dtype=ids.dtype)[:, None] * chunk
    best, at = jax.lax.top_k(vals.reshape(*lead, num_chunks * k), k)
    return best, jnp.take_along_axis(ids.reshape(*lead, num_chunks * k), at, axis=-1)


def _filter(logits, f, i):
    """top-k / top-p / min-p on temperature-scaled logits (needs one descending sort). As in Hugging Face
    and vLLM, top-p measures its mass over the tokens top-k kept (renormalized); min-p is relative to
    the most likely token, which every filter keeps."""
    vocab = logits.shape[-1]
    sorted_desc = _sort_desc(logits)
    k = jnp.where(i[:, I_TOP_K] > 0, jnp.minimum(i[:, I_TOP_K], vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    top_p = f[:, F_TOP_P:F_TOP_P + 1]
    keep = (cum_before < top_p) | (top_p >= 1.0)   # top_p = 1 keeps all (cumsum rounding must not cut the tail)
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    min_logit = sorted_desc[:, :1] + jnp.log(jnp.maximum(f[:, F_MIN_P:F_MIN_P + 1], 1e-30))
    threshold = jnp.maximum(jnp.maximum(kth, pth), jnp.where(f[:, F_MIN_P:F_MIN_P + 1] > 0, min_logit, -jnp.inf))
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _top_logprobs(logprobs):
    vals, ids = _top_k(logprobs, MAX_LOGPROBS)
    return vals, ids.astype(jnp.int32)


def _logprobs_of(logprobs, tokens):
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return (chosen, *_top_logprobs(logprobs))


def _no_logprobs(rows):
    return (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.float32),
            jnp.zeros((rows, MAX_LOGPROBS), jnp.int32))


def logit_bias_row(bias: dict[int, float] | None) -> tuple[np.ndarray, np.ndarray]:
    """Host side: one request's bias table (`SamplingParams.bias_table`) as [MAX_LOGIT_BIAS] token ids and
    values (padding: BIAS_PAD, +0)."""
    ids, vals = np.full(MAX_LOGIT_BIAS, BIAS_PAD, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32)
    if bias:
        ids[:len(bias)] = list(bias)
        vals[:len(bias)] = list(bias.values())
    return ids, vals


def banned_by_bad_words(table, recent, vocab: int):
    """[rows, vocab] bool: the last token of each bad-word sequence whose earlier tokens the row generated last.
    table [rows, S, L]: sequences right-aligned, -1 before them; recent [rows, L - 1]: the row's last
    generated tokens, -1 where it has fewer (atlasjax/bad_words.py)."""
    prefix, last = table[..., :-1], table[..., -1]
    match = jnp.all((prefix < 0) | (prefix == recent[:, None, :]), axis=-1) & (last >= 0)
    rows = table.shape[0]
    return jnp.zeros((rows, vocab), bool).at[jnp.arange(rows)[:, None], jnp.maximum(last, 0)].max(match)


def sample(logits, counts, prompt_mask, st: SamplingTensors, plan: SamplingPlan = FULL, bias=None, bad=None):
    """logits: [rows, vocab] f32 -> (tokens [rows], chosen logprob [rows], top vals/ids [rows, K]).

    bias: (token ids, values), each [rows, MAX_LOGIT_BIAS], added to the logits; a row whose F_ONLY_LISTED
    is set (allowed_token_ids) may pick only the listed ids. bad: (bad-word table, recent tokens) per row
    (`banned_by_bad_words`). None applies with a greedy plan, which no such row gets. Logprobs are zeros
    unless `plan.logprobs`."""
    f, i = st.floats, st.ints
    rows, vocab = logits.shape
    if plan.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        lp = _logprobs_of(jax.nn.log_softmax(logits, axis=-1), tokens) if plan.logprobs else _no_logprobs(rows)
        return (tokens, *lp)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = apply_penalties(logits, counts, prompt_mask, f)
    if bias is not None:
        at = (jnp.arange(rows)[:, None], bias[0])
        logits = logits.at[at].add(bias[1], mode="drop")
        listed = jnp.zeros((rows, vocab), bool).at[at].set(True, mode="drop")
        logits = jnp.where((f[:, F_ONLY_LISTED:F_ONLY_LISTED + 1] > 0) & ~listed, -jnp.inf, logits)
    if bad is not None:
        logits = jnp.where(banned_by_bad_words(*bad, vocab), -jnp.inf, logits)
    # min_tokens: stop ids may not be chosen yet
    stop_ids = i[:, 5:]
    block = (i[:, I_STEP] < i[:, I_MIN_TOKENS])[:, None] & (stop_ids >= 0)
    blocked = jnp.zeros((rows, vocab), bool).at[jnp.arange(rows)[:, None], jnp.maximum(stop_ids, 0)].max(block)
    logits = jnp.where(blocked, -jnp.inf, logits)
    greedy = jnp.argmax(logits, axis=-1)
    temp = f[:, F_TEMP:F_TEMP + 1]
    scaled = logits / jnp.where(temp > 0, temp, 1.0)
    scaled = _filter(scaled, f, i)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(i[:, I_SEED], i[:, I_STEP])
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
    sampled = jnp.argmax(scaled + gumbel, axis=-1)
    tokens = jnp.where(f[:, F_TEMP] > 0, sampled, greedy).astype(jnp.int32)
    return (tokens, *(_logprobs_of(logprobs, tokens) if plan.logprobs else _no_logprobs(rows)))


def prompt_logprobs(logits, next_tokens):
    """logits [tokens, vocab] f32, next_tokens [tokens] -> logprob of each next token + top-K."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_tokens, 0)[:, None], axis=-1)[:, 0]
    vals, ids = _top_logprobs(logprobs)
    return chosen, vals, ids

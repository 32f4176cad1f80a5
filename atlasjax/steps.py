"""The step programs: pure functions of (params, device state, packed host inputs) that `ModelRunner`
(atlasjax/runner.py) compiles per shape bucket and runs with the device state donated.

Device state (donated to every step, so it is updated in place and never copied):
  kv:          per layer (k_pages, v_pages) [kv_heads, num_pages, page_size, head_dim]
  counts:      [max_num_seqs, vocab] int32, generated-token counts per slot (penalties)
  prompt_mask: [max_num_seqs, vocab] bool, tokens seen in the prompt per slot (repetition penalty)
  bias_ids, bias_vals: [max_num_seqs, MAX_LOGIT_BIAS] int32 / f32, each slot's bias table (its logit_bias,
  or its allowed_token_ids with their biases; set at admit)
  bad_words:   [max_num_seqs, MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS] int32, each slot's bad-word sequences
               (atlasjax/bad_words.py; set at admit)
  recent:      [max_num_seqs, MAX_BAD_WORD_TOKENS - 1] int32, each slot's last generated tokens (-1: none yet),
               which bad words of several tokens match; set at admit, advanced by every step that samples with
               the full plan (a request with bad words never runs a greedy-plan step)
  draft_kv:    a draft model's KV pool, as kv (speculative decoding with a draft model; () without): the same
               pages as the target's, and every step that runs the target over tokens runs the draft over them
               too (`drafting.run_draft`), so the draft's cache always holds what the target's holds. An EAGLE-3 head's
               (one layer) follows the target the same way, one position behind (`drafting.eagle_follow`)
  draft_hidden: [max_num_seqs, hidden] an EAGLE-3 head's output at each slot's last position, which its
               next drafts start from (() without a head)
  history:     [max_num_seqs, max_model_len] int32, each slot's tokens by position, which n-gram drafts proposed on
               the device look up (atlasjax/ngram_lookup.py; () without them): written whole by the admit step, then
               by every step that runs a token at its position (`step_rows.record_tokens`; a prompt's by the admit
               step), so a slot's history is valid up to its newest token's position (past it: tokens of drafts not
               accepted)

A step's small host inputs cross to the device as one packed int32 array (`pack_host`).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from atlasjax import drafting, sampling
from atlasjax.step_rows import record_tokens, slot_rows, token_sequences
from models.attention import AttentionMetadata
from models.transformer import Transformer
from pallas_kernels.kv_write import decode_slots

@flax.struct.dataclass
class DeviceState:
    kv: tuple
    counts: jax.Array
    prompt_mask: jax.Array
    bias_ids: jax.Array
    bias_vals: jax.Array
    bad_words: jax.Array
    recent: jax.Array
    draft_kv: tuple = ()
    draft_hidden: jax.Array | tuple = ()
    history: jax.Array | tuple = ()


@flax.struct.dataclass
class StepOutput:
    tokens: jax.Array        # [rows] int32
    logprob: jax.Array       # [rows] f32 (chosen token, raw distribution)
    top_vals: jax.Array      # [rows, MAX_LOGPROBS]
    top_ids: jax.Array
    prompt: tuple | None = None   # (chosen [T], top_vals [T, K], top_ids [T, K]) with prompt logprobs
    # Decode steps: [max_num_seqs] each row's newest token, zero past the step's rows (a multi-step decode's
    # tokens, logprob, top_vals and top_ids gain a leading [num_steps] axis; this is its final token). A
    # later step gathers from it, so that step compiles the same whatever this one's row count.
    last_tokens: jax.Array | None = None
    inputs: jax.Array | None = None   # a verify step's token rows [T]: each request's last token and its drafts
    # Verify rounds (atlasjax/verify_rounds.py): tokens, logprobs and inputs gain a leading [rounds] axis, and this
    # [rounds, requests] holds the tokens each request emitted in each round (0: it sat that round out)
    advance: jax.Array | None = None
    # Verify rounds, per request [max_num_seqs]: the tokens the launch emitted, and those the launch before it emitted
    # that this one moved its rows along by (pipelined launches; its newest token is in `last_tokens`)
    emitted: jax.Array | None = None
    shift: jax.Array | None = None
    proposed: jax.Array | None = None   # verify rounds with n-gram drafts: [rounds, requests] the drafts looked up

    @property
    def gather_tokens(self) -> jax.Array:
        """[max_num_seqs]: the tokens a later step continues from (negative `tokens` entries index these)."""
        return self.tokens if self.last_tokens is None else self.last_tokens


_PACK_ALIGN = 64   # int32 elements = 256 bytes: XLA may hand a slice of the packed buffer straight to a
                   # kernel (the page table to attention), and GPU kernels require 256-byte aligned operands


def pack_host(arrays) -> tuple[np.ndarray, tuple]:
    """Several small host arrays (int32 / float32 / bool) as one flat int32 array, so a step's host
    inputs cross to the device in one transfer; `unpack_host` (inside the step) undoes it."""
    arrays = [np.asarray(a) for a in arrays]
    layout = tuple((a.shape, a.dtype.name) for a in arrays)
    flat = []
    for a in arrays:
        x = (a.astype(np.int32) if a.dtype == np.bool_ else np.ascontiguousarray(a)).view(np.int32).ravel()
        flat += [x, np.zeros(-x.size % _PACK_ALIGN, np.int32)]
    return np.concatenate(flat), layout


def unpack_host(packed: jax.Array, layout: tuple) -> list[jax.Array]:
    out, offset = [], 0
    for shape, dtype in layout:
        n = int(np.prod(shape))
        x = packed[offset:offset + n].reshape(shape)
        offset += n + -n % _PACK_ALIGN
        if dtype == "float32":
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        elif dtype == "bool":
            x = x != 0
        out.append(x)
    return out


def _gather_prev(tokens, prev_prefill_tokens, prev_decode_tokens):
    # [R] tokens at position seq_lens - 1 of each row. A token -1 - r stands for row r of the previous
    # step's sampled tokens (its prefill's [S], then its decode's, padded to [S]), still on the device: the
    # host schedules this step before reading those back.
    prev = jnp.concatenate([prev_prefill_tokens, prev_decode_tokens])
    return jnp.where(tokens >= 0, tokens, prev[jnp.clip(-1 - tokens, 0, prev.shape[0] - 1)])


def _run_model(model: Transformer, params, lora, tokens, positions, kv, meta, token_slots):
    """The model over a step's tokens -> (hidden, kv, aux: the EAGLE-3 head's features, or None). lora: the runner's
    LoRA tree (atlasjax/lora.py) or None; with it each token runs its engine slot's adapter (token_slots: each
    token's engine slot; padding: any)."""
    if lora is None:
        out = model.apply({"params": params}, tokens, positions, kv, meta)
    else:
        out = model.apply({"params": params, "lora": lora["layers"]}, tokens, positions, kv, meta,
                          slot_rows(lora["adapter_of_slot"], token_slots))
    return out if len(out) == 3 else (*out, None)


def _padded_to_slots(tokens, num_slots: int):
    return jnp.pad(tokens, (0, num_slots - tokens.shape[0]))


def _sample_rows(state: DeviceState, counts, recent, logits, slots, st, plan=sampling.FULL):
    """Sample each row with its slot's penalty state, logit bias and bad words (the greedy plans read none,
    and XLA drops these gathers from them)."""
    bias = (slot_rows(state.bias_ids, slots), slot_rows(state.bias_vals, slots))
    bad = (slot_rows(state.bad_words, slots), slot_rows(recent, slots))
    return sampling.sample(logits, slot_rows(counts, slots), slot_rows(state.prompt_mask, slots), st, plan, bias,
                           bad)


def _advance_recent(recent, slots, new_tokens):
    """Each sampled row's slot history with its new token last (rows whose slot is out of range: dropped)."""
    rows = slot_rows(recent, slots)
    return recent.at[slots].set(jnp.concatenate([rows[:, 1:], new_tokens[:, None]], axis=1), mode="drop")


def _decode_once(model: Transformer, plan, params, kv, counts, recent, state: DeviceState, tokens, page_table,
                 seq_lens, slots, st, split_rows=None, lora=None, draft=None, draft_params=None,
                 draft_state=((), (), ())):
    """One decode iteration over the step's rows: row r continues the request in slot slots[r];
    seq_lens == 0 marks a padding row (no K/V write, no count; its slot is out of range). `state` gives the
    per-slot sampling state; kv, counts, recent and draft_state (draft_kv, draft_hidden, history) are the
    iteration's own.
    split_rows: AttentionMetadata's. lora: the runner's LoRA tree (atlasjax/lora.py), or None. draft:
    `drafting.Draft`, `drafting.Eagle3Draft`, `drafting.NgramDraft` (nothing to run here) or None.
    Returns (kv, draft_state, counts, recent, StepOutput)."""
    _, num_pages, page_size, _ = kv[0][0].shape
    positions = jnp.maximum(seq_lens - 1, 0)
    slot_mapping = decode_slots(page_table, seq_lens, page_size, num_pages)
    meta = AttentionMetadata(slot_mapping=slot_mapping, page_table=page_table, seq_lens=seq_lens,
                             split_rows=split_rows)
    hidden, kv, aux = _run_model(model, params, lora, tokens, positions, kv, meta, slots)
    draft_kv, draft_hidden, history = draft_state
    history = record_tokens(history, jnp.where(seq_lens > 0, slots, counts.shape[0]), positions, tokens)
    draft_kv = drafting.run_draft(draft, draft_params, tokens, positions, draft_kv, meta)
    logits = model.apply({"params": params}, hidden, method=Transformer.logits)
    new_tokens, lp, tv, ti = _sample_rows(state, counts, recent, logits, slots, st, plan)
    if isinstance(draft, drafting.Eagle3Draft):
        draft_kv, prenorm = drafting.eagle_follow(draft, draft_params, model, params, aux, new_tokens, positions,
                                                  draft_kv, meta)
        draft_hidden = draft_hidden.at[jnp.where(seq_lens > 0, slots, counts.shape[0])].set(prenorm, mode="drop")
    counts = counts.at[slots, new_tokens].add((seq_lens > 0).astype(jnp.int32), mode="drop")
    if not plan.greedy:
        recent = _advance_recent(recent, jnp.where(seq_lens > 0, slots, counts.shape[0]), new_tokens)
    return kv, (draft_kv, draft_hidden, history), counts, recent, StepOutput(new_tokens, lp, tv, ti)


def decode_step(model: Transformer, plan: sampling.SamplingPlan, layout, params, lora, state: DeviceState, packed,
                prev_prefill_tokens, prev_decode_tokens, draft_params=None, *, split_rows=None, draft=None):
    """One decode iteration (split_rows: the attention's, AttentionMetadata; lora, draft: `_decode_once`'s)."""
    tokens, page_table, seq_lens, slots, f, i = unpack_host(packed, layout)
    tokens = _gather_prev(tokens, prev_prefill_tokens, prev_decode_tokens)
    kv, (draft_kv, draft_hidden, history), counts, recent, out = _decode_once(
        model, plan, params, state.kv, state.counts, state.recent, state, tokens, page_table, seq_lens, slots,
        sampling.SamplingTensors(f, i), split_rows, lora, draft, draft_params,
        (state.draft_kv, state.draft_hidden, state.history))
    out = out.replace(last_tokens=_padded_to_slots(out.tokens, counts.shape[0]))
    return state.replace(kv=kv, draft_kv=draft_kv, draft_hidden=draft_hidden, history=history, counts=counts,
                         recent=recent), out


def multi_decode_step(model: Transformer, plan: sampling.SamplingPlan, num_steps: int, layout, params, lora,
                      state: DeviceState, packed, prev_prefill_tokens, prev_decode_tokens, draft_params=None, *,
                      split_rows=None, draft=None):
    """`num_steps` decode iterations in one launch (a `lax.scan`, so the host issues the step once for
    all of them). Row r runs the first row_steps[r] iterations, each feeding back its own token;
    after them it is inactive (no K/V write), and its later outputs repeat its last token."""
    tokens, page_table, seq_lens, slots, f, i, row_steps = unpack_host(packed, layout)
    tokens = _gather_prev(tokens, prev_prefill_tokens, prev_decode_tokens)

    def body(carry, j):
        kv, draft_state, counts, recent, tokens = carry
        active = (seq_lens > 0) & (j < row_steps)
        # the seeded draw and min_tokens follow the row's output index, as one step per launch would
        st = sampling.SamplingTensors(f, i.at[:, sampling.I_STEP].add(j))
        kv, draft_state, counts, recent, out = _decode_once(
            model, plan, params, kv, counts, recent, state, tokens, page_table, jnp.where(active, seq_lens + j, 0),
            slots, st, split_rows, lora, draft, draft_params, draft_state)
        tokens = jnp.where(active, out.tokens, tokens)
        return (kv, draft_state, counts, recent, tokens), (tokens, out.logprob, out.top_vals, out.top_ids)

    (kv, (draft_kv, draft_hidden, history), counts, recent, tokens), outs = jax.lax.scan(
        body, (state.kv, (state.draft_kv, state.draft_hidden, state.history), state.counts, state.recent, tokens),
        jnp.arange(num_steps))
    return state.replace(kv=kv, draft_kv=draft_kv, draft_hidden=draft_hidden, history=history, counts=counts,
                         recent=recent), StepOutput(*outs, last_tokens=_padded_to_slots(tokens, counts.shape[0]))


PREFILL_INPUTS = ("tokens", "positions", "slot_mapping", "page_table", "seq_lens", "query_start", "num_seqs",
                  "sample_rows", "slot_ids", "commit", "next_tokens")


def prefill_step(model: Transformer, with_prompt_logprobs: bool, layout, params, lora, state: DeviceState, packed,
                 draft_params=None, *, draft=None):
    (tokens, positions, slot_mapping, page_table, seq_lens, query_start, num_seqs, sample_rows, slot_ids, commit,
     next_tokens, f, i) = unpack_host(packed, layout)
    st = sampling.SamplingTensors(f, i)
    # Packed chunks of up to S sequences: [T] tokens; logits only at each sequence's last row.
    meta = AttentionMetadata(slot_mapping=slot_mapping, page_table=page_table, seq_lens=seq_lens,
                             query_start=query_start, num_seqs=num_seqs)
    token_slots = None
    if lora is not None:   # each token's engine slot: its sequence's (tokens past the sequences: the last's)
        token_slots = slot_ids[jnp.minimum(token_sequences(query_start, tokens.shape[0]), slot_ids.shape[0] - 1)]
    hidden, kv, aux = _run_model(model, params, lora, tokens, positions, state.kv, meta, token_slots)
    state = state.replace(draft_kv=drafting.run_draft(draft, draft_params, tokens, positions, state.draft_kv, meta))
    logits = model.apply({"params": params}, hidden[sample_rows], method=Transformer.logits)
    slots = jnp.where(commit, slot_ids, state.counts.shape[0])   # out of range: the count's scatter drops it
    new_tokens, lp, tv, ti = _sample_rows(state, state.counts, state.recent, logits, slots, st)
    if isinstance(draft, drafting.Eagle3Draft):   # a completed prompt's last row is followed by the token just sampled
        follow = next_tokens.at[jnp.where(commit, sample_rows, tokens.shape[0])].set(new_tokens, mode="drop")
        draft_kv, prenorm = drafting.eagle_follow(draft, draft_params, model, params, aux, follow, positions,
                                                  state.draft_kv, meta)
        ends = jnp.where(jnp.arange(slot_ids.shape[0]) < num_seqs, slot_ids, state.counts.shape[0])   # each chunk's
        state = state.replace(draft_kv=draft_kv,
                              draft_hidden=state.draft_hidden.at[ends].set(prenorm[sample_rows], mode="drop"))
    counts = state.counts.at[slots, new_tokens].add(1, mode="drop")
    state = state.replace(recent=_advance_recent(state.recent, slots, new_tokens))
    out = StepOutput(new_tokens, lp, tv, ti)
    if with_prompt_logprobs:
        all_logits = model.apply({"params": params}, hidden, method=Transformer.logits)
        out = out.replace(prompt=sampling.prompt_logprobs(all_logits, next_tokens))
    return state.replace(kv=kv, counts=counts), out


VERIFY_INPUTS = ("tokens", "positions", "slot_mapping", "page_table", "seq_lens", "query_start", "num_seqs",
                 "row_slots")


def verify_step(model: Transformer, plan: sampling.SamplingPlan, layout, params, lora, state: DeviceState, packed,
                prev_prefill_tokens, prev_decode_tokens, draft_params=None, *, draft=None):
    """Speculative decoding's verify (atlasjax/speculative.py): chunks of each request's last token and its
    drafts, packed as prefill chunks are, write their K/V and sample a token at every row with the row's
    settings (`step_packing.pack_verify`); a last token still on the device is gathered as a decode's is.
    With a draft model (`drafting.Draft`) its drafts are proposed first, here (`drafting.propose`), into the rows
    the host reserved. Only requests without penalties or bad words speculate, so the per-slot counts and recent
    tokens are read (bias tables) but not advanced. The output's `inputs` are the rows' tokens, drafts included."""
    tokens, positions, slot_mapping, page_table, seq_lens, query_start, num_seqs, row_slots, f, i = unpack_host(
        packed, layout)
    tokens = _gather_prev(tokens, prev_prefill_tokens, prev_decode_tokens)
    draft_kv, draft_hidden = state.draft_kv, state.draft_hidden
    if isinstance(draft, drafting.Draft):
        draft_kv, tokens = drafting.propose(draft, draft_params, draft_kv, tokens, page_table, seq_lens,
                                            query_start, num_seqs)
    elif isinstance(draft, drafting.Eagle3Draft):
        draft_kv, tokens = drafting.eagle_propose(draft, draft_params, model, params, draft_hidden, draft_kv,
                                                  tokens, page_table, seq_lens, query_start, num_seqs, row_slots)
    meta = AttentionMetadata(slot_mapping=slot_mapping, page_table=page_table, seq_lens=seq_lens,
                             query_start=query_start, num_seqs=num_seqs)
    hidden, kv, aux = _run_model(model, params, lora, tokens, positions, state.kv, meta, row_slots)
    state = state.replace(history=record_tokens(state.history, row_slots, positions, tokens))
    logits = model.apply({"params": params}, hidden, method=Transformer.logits)
    new_tokens, lp, tv, ti = _sample_rows(state, state.counts, state.recent, logits, row_slots,
                                          sampling.SamplingTensors(f, i), plan)
    if isinstance(draft, drafting.Eagle3Draft):   # each row is followed by the token sampled at it; the slot keeps the
        # head's output at the request's last accepted row
        draft_kv, prenorm = drafting.eagle_follow(draft, draft_params, model, params, aux, new_tokens, positions,
                                                  draft_kv, meta)
        rows, real = drafting.accepted_rows(tokens, new_tokens, query_start, num_seqs, draft.num_tokens)
        slots = jnp.where(real, row_slots[jnp.minimum(query_start[:rows.shape[0]], tokens.shape[0] - 1)],
                          draft_hidden.shape[0])
        draft_hidden = draft_hidden.at[slots].set(prenorm[rows], mode="drop")
    return state.replace(kv=kv, draft_kv=draft_kv, draft_hidden=draft_hidden), StepOutput(
        new_tokens, lp, tv, ti, inputs=tokens)


def admit_step(layout, state: DeviceState, packed):
    """Reset the sampling state of the slots that requests admitted in one step take over (several
    requests in one program). Host inputs: slots [A] (padding rows: max_num_seqs, dropped), starts [A + 1]
    (request r's tokens are tokens[starts[r]:starts[r + 1]]: its prompt, then, after a preemption, its
    earlier outputs), prompt_lens [A], tokens [L] (all the requests' tokens, one after another), and each
    request's logit bias [A, MAX_LOGIT_BIAS] ids and values and bad-word table [A, MAX_BAD_WORD_SEQS,
    MAX_BAD_WORD_TOKENS]. A slot's prompt mask becomes the tokens of its request, its generated counts those past
    its prompt, its logit bias and bad words the request's, its recent tokens the last it generated, and its token
    history (with n-gram drafts on the device) its tokens."""
    slots, starts, prompt_lens, tokens, bias_ids, bias_vals, bad_words = unpack_host(packed, layout)
    num_slots, rows = state.counts.shape[0], slots.shape[0]
    idx = jnp.arange(tokens.shape[0])
    row = token_sequences(starts, tokens.shape[0])   # [L] each token's request (`rows` past the last)
    in_seq = row < rows
    row = jnp.minimum(row, rows - 1)
    token_slot = jnp.where(in_seq, slots[row], num_slots)   # out of range: dropped
    generated = (in_seq & (idx - starts[row] >= prompt_lens[row])).astype(jnp.int32)
    counts = state.counts.at[slots].set(0, mode="drop").at[token_slot, tokens].add(generated, mode="drop")
    mask = state.prompt_mask.at[slots].set(False, mode="drop").at[token_slot, tokens].max(in_seq, mode="drop")
    history = state.recent.shape[1]
    at = starts[1:, None] - history + jnp.arange(history)[None, :]          # [A, H] each request's last H tokens
    generated = at >= (starts[:-1] + prompt_lens)[:, None]
    recent = jnp.where(generated, tokens[jnp.clip(at, 0, tokens.shape[0] - 1)], -1)
    state = state.replace(history=record_tokens(state.history, token_slot, idx - starts[row], tokens))
    return state.replace(counts=counts, prompt_mask=mask, bias_ids=state.bias_ids.at[slots].set(bias_ids, mode="drop"),
                         bias_vals=state.bias_vals.at[slots].set(bias_vals, mode="drop"),
                         bad_words=state.bad_words.at[slots].set(bad_words, mode="drop"),
                         recent=state.recent.at[slots].set(recent, mode="drop"))

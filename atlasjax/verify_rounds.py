"""Several speculative verify rounds in one launch, for drafts proposed on the device (a draft model's, an EAGLE-3
head's, or n-gram lookups in the device's token history, atlasjax/ngram_lookup.py): the host issues the step once
for all of them, as `steps.multi_decode_step` does for plain decoding.

A verify step reads back before the next is scheduled (its accepted drafts move every later position), so each
launch pays the host's work of a step in full; with R rounds per launch that work is paid once per R rounds. Each
round is `steps.verify_step`'s work: propose each request's drafts, run the target over its last token and drafts,
sample every row, accept the drafts up to the first that differs from the token sampled before it. The next round
continues from each request's newest token, its rows moved along by the tokens it emitted; the rows keep their
layout (`query_start`), so every round compiles to the same program.

A request sits a round out (no K/V write, no tokens) once it has emitted its budget (`budgets`: the tokens its
max_tokens leaves) or reached the end of the pages it holds (`caps`: its page count times the page size); rows
past its pages write nothing, and a draft there is never accepted. Its later rounds emit nothing, and tokens past a
stop are dropped by the engine, as after a multi-step decode.

Pipelined launches: the host may schedule launch N+1 while launch N still runs (atlasjax/engine.py says when). It
then packs each request from the tokens it knows (those before launch N) and names the request's index in launch N
(`shift_from`); the step moves the request along by what launch N emitted for it (`StepOutput.emitted`, gathered
as `prev_emitted`) and takes its newest token from launch N's `last_tokens`, as a decode gathers a pending token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from atlasjax import drafting, ngram_lookup, sampling
from atlasjax.step_rows import record_tokens, token_sequences
from atlasjax.steps import DeviceState, StepOutput, _gather_prev, _run_model, _sample_rows, unpack_host
from models.attention import AttentionMetadata
from models.transformer import Transformer

ROUND_INPUTS = ("budgets", "caps", "shift_from")   # [num_slots] each: after steps.VERIFY_INPUTS


def verify_rounds_step(model: Transformer, plan: sampling.SamplingPlan, num_rounds: int, layout, params, lora,
                       state: DeviceState, packed, prev_prefill_tokens, prev_decode_tokens, prev_emitted,
                       draft_params=None, *, draft: drafting.Draft | drafting.Eagle3Draft | drafting.NgramDraft):
    """`num_rounds` verify rounds over a batch of `step_packing.pack_verify` (round 0's rows) with each request's
    budget and cap; a request with `shift_from` r >= 0 first moves along by prev_emitted[r] tokens (the launch in
    flight when this one was scheduled). Outputs: `StepOutput` with a leading [num_rounds] axis, `advance`, and per
    request [num_slots] `emitted`, `last_tokens` (its newest token) and `shift`; n-gram drafts also `proposed`
    [num_rounds, requests], the drafts each request's lookup found in each round (the rows past them are never
    accepted)."""
    (tokens, positions, _, page_table, seq_lens, query_start, num_seqs, row_slots, budgets, caps, shift_from, f,
     i) = unpack_host(packed, layout)
    tokens = _gather_prev(tokens, prev_prefill_tokens, prev_decode_tokens)
    _, num_pages, page_size, _ = state.kv[0][0].shape
    t = tokens.shape[0]
    n = min(seq_lens.shape[0], t)   # requests a step of t rows can hold (each has one row at least)
    row_req = token_sequences(query_start, t)    # [t] each row's request (num_seqs or more: padding)
    rq = jnp.minimum(row_req, n - 1)
    start, chunk = query_start[:n], query_start[1:n + 1] - query_start[:n]
    real_row = row_req < num_seqs
    real = jnp.arange(n) < num_seqs
    # tokens the launch before emitted for each request (pipelined: not known to the host when it packed this one)
    shift_from = shift_from[:n]
    shift = jnp.where(real & (shift_from >= 0), prev_emitted[jnp.clip(shift_from, 0, prev_emitted.shape[0] - 1)], 0)
    seq_lens = seq_lens.at[:n].add(shift)
    last = seq_lens[:n] - chunk                   # round 0: the position of each request's last token
    offset = jnp.arange(t) - start[rq]            # each row's place in its request's chunk
    budgets, caps = budgets[:n] - shift, caps[:n]
    i = i.at[:, sampling.I_STEP].add(jnp.where(real_row, shift[rq], 0))   # each row's output index
    num_drafts = draft.num_tokens

    req_slots = row_slots[jnp.minimum(start, t - 1)]   # each request's engine slot

    def body(carry, _):
        kv, draft_kv, draft_hidden, history, tokens, emitted, newest = carry   # emitted: [n] tokens so far, per request
        active = real & (emitted < budgets) & (last + emitted < caps)
        pos = jnp.where(real_row, last[rq] + emitted[rq] + offset, positions)
        row_on = real_row & active[rq] & (pos < caps[rq])
        found = chunk - 1   # drafts proposed per request
        page = page_table[rq, jnp.minimum(pos // page_size, page_table.shape[1] - 1)]
        meta = AttentionMetadata(slot_mapping=jnp.where(row_on, page * page_size + pos % page_size,
                                                        num_pages * page_size),
                                 page_table=page_table, seq_lens=seq_lens.at[:n].add(emitted),
                                 query_start=query_start, num_seqs=num_seqs)
        if isinstance(draft, drafting.Draft):
            draft_kv, tokens = drafting.propose(draft, draft_params, draft_kv, tokens, page_table, meta.seq_lens,
                                                query_start, num_seqs, active, caps)
        elif isinstance(draft, drafting.Eagle3Draft):
            draft_kv, tokens = drafting.eagle_propose(draft, draft_params, model, params, draft_hidden, draft_kv,
                                                      tokens, page_table, meta.seq_lens, query_start, num_seqs,
                                                      row_slots, active, caps)
        else:   # looked up in the history, its newest token (row 0 of its chunk) recorded first
            history = record_tokens(history, jnp.where(active, req_slots, history.shape[0]), last + emitted,
                                    tokens[start])
            drafts, found = ngram_lookup.propose(history[req_slots], last + emitted,
                                                 jnp.minimum(chunk - 1, budgets - emitted - 1), num_drafts,
                                                 draft.min_n, draft.max_n)
            tokens = jnp.where(real_row & (offset > 0), drafts[rq, jnp.maximum(offset - 1, 0)], tokens)
            history = record_tokens(history, jnp.where(row_on, row_slots, history.shape[0]), pos, tokens)
        hidden, kv, aux = _run_model(model, params, lora, tokens, pos, kv, meta, row_slots)
        logits = model.apply({"params": params}, hidden, method=Transformer.logits)
        # each row draws with the seed stream and min_tokens of its output index, as one round per launch would
        st = sampling.SamplingTensors(f, i.at[:, sampling.I_STEP].add(emitted[rq]))
        new_tokens, lp, tv, ti = _sample_rows(state, state.counts, state.recent, logits, row_slots, st, plan)
        rows, _ = drafting.accepted_rows(tokens, new_tokens, query_start, num_seqs, num_drafts)
        rows = jnp.minimum(rows, start + caps - (last + emitted) - 1)   # no draft past its pages (K/V unwritten)
        rows = jnp.minimum(rows, start + found)   # nor past those proposed
        advance = jnp.where(active, rows - start + 1, 0)
        proposed = jnp.where(active, jnp.minimum(found, caps - (last + emitted) - 1), 0)
        if isinstance(draft, drafting.Eagle3Draft):   # as verify_step: the slot keeps the head's output at the
            # accepted row
            draft_kv, prenorm = drafting.eagle_follow(draft, draft_params, model, params, aux, new_tokens, pos,
                                                      draft_kv, meta)
            slots = jnp.where(active, req_slots, draft_hidden.shape[0])
            draft_hidden = draft_hidden.at[slots].set(prenorm[rows], mode="drop")
        # the next round starts from each request's newest token (its drafts are proposed into the rows after it)
        next_tokens = jnp.where((offset == 0) & row_on, new_tokens[rows][rq], tokens)
        newest = jnp.where(active, new_tokens[rows], newest)
        return (kv, draft_kv, draft_hidden, history, next_tokens, emitted + advance, newest), (
            new_tokens, lp, tv, ti, tokens, advance, proposed)

    s = prev_emitted.shape[0]
    (kv, draft_kv, draft_hidden, history, _, emitted, newest), (new_tokens, lp, tv, ti, inputs, advance,
                                                                proposed) = jax.lax.scan(
        body, (state.kv, state.draft_kv, state.draft_hidden, state.history, tokens, jnp.zeros(n, jnp.int32),
               tokens[jnp.minimum(start, t - 1)]), None, length=num_rounds)

    def per_request(x):   # [n] -> [num_slots]
        return jnp.zeros(s, jnp.int32).at[:n].set(jnp.where(real, x, 0))
    return state.replace(kv=kv, draft_kv=draft_kv, draft_hidden=draft_hidden, history=history), StepOutput(
        new_tokens, lp, tv, ti, inputs=inputs, advance=advance, last_tokens=per_request(newest),
        emitted=per_request(emitted), shift=per_request(shift),
        proposed=proposed if isinstance(draft, drafting.NgramDraft) else None)

"""Speculative drafting inside the step programs (atlasjax/steps.py, atlasjax/verify_rounds.py): what drafts a
runner proposes (`Draft`: a draft model, `Eagle3Draft`: an EAGLE-3 head, `NgramDraft`: n-gram lookups on the
device), static in the programs, and the passes that keep a draft's cache beside the target's, propose drafts into
a verify step's rows and find the rows each request accepts."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from atlasjax.step_rows import slot_rows, token_sequences
from models.attention import AttentionMetadata
from models.eagle3 import Eagle3Head
from models.transformer import Transformer
from pallas_kernels.kv_write import decode_slots


@dataclasses.dataclass(frozen=True)
class Draft:
    """Speculative decoding's draft model (atlasjax/draft_model.py), static in the step programs: its module, the
    drafts it proposes per request and step, and the tokens it may propose (the target's vocabulary)."""
    model: Transformer
    num_tokens: int
    vocab: int


@dataclasses.dataclass(frozen=True)
class Eagle3Draft:
    """Speculative decoding's EAGLE-3 head (atlasjax/eagle3.py), static in the step programs: its module, the drafts
    it proposes per request and step, and whether it has an embedding of its own (else it reads the target's)."""
    head: Eagle3Head   # or sharding.Replicated(Eagle3Head) beside a tensor-parallel target
    num_tokens: int
    own_embedding: bool


@dataclasses.dataclass(frozen=True)
class NgramDraft:
    """n-gram (prompt lookup) drafts proposed on the device (atlasjax/ngram_lookup.py), static in the step programs:
    the drafts per request and round, and the suffix n-grams looked up. Only verify-rounds launches propose them; a
    one-round verify step verifies the host's lookups."""
    num_tokens: int
    min_n: int
    max_n: int


def run_draft(draft, draft_params, tokens, positions, kv, meta):
    """The draft model over the tokens the target runs in this step (the same positions and pages) -> its kv (an
    EAGLE-3 head runs after the target instead: `eagle_follow`)."""
    if not isinstance(draft, Draft):
        return kv
    return draft.model.apply({"params": draft_params}, tokens, positions, kv, meta)[1]


def _eagle_embed(draft: Eagle3Draft, draft_params, model, params, tokens):
    tokens = jnp.maximum(tokens, 0)   # -1: a row whose next token is unknown (padding, or past what is accepted)
    if draft.own_embedding:
        return draft.head.apply({"params": draft_params}, tokens, method=Eagle3Head.embed)
    return model.apply({"params": params}, tokens, method=Transformer.embed)


def eagle_follow(draft: Eagle3Draft, draft_params, model, params, aux, next_tokens, positions, draft_kv, meta):
    """The EAGLE-3 head over the rows the target just ran: row i (position p) takes the token at p + 1 (the next
    prompt token, or the one sampled at row i) and the target's features at p, and writes the head's K/V at p, so
    its cache covers what the target's does. -> (draft_kv, the head's output per row [rows, hidden])."""
    embeds = _eagle_embed(draft, draft_params, model, params, next_tokens)
    prenorm, draft_kv = draft.head.apply({"params": draft_params}, embeds, aux, positions, draft_kv, meta)
    return draft_kv, prenorm


def eagle_propose(draft: Eagle3Draft, draft_params, model, params, draft_hidden, kv, tokens, page_table, seq_lens,
                  query_start, num_seqs, row_slots, active=None, caps=None):
    """An EAGLE-3 head's greedy drafts, filled into a verify step's rows (as `propose`): request i's last token
    sits at position L, and its slot keeps the head's output at L - 1, whose prediction is draft 1; iteration j
    takes draft j and the previous output at position L + j - 1 and proposes draft j + 1. Its K/V writes
    (positions L onwards) are overwritten by `eagle_follow` after the verify. active: [rows] whether request i
    drafts at all (None: all; an inactive one writes nothing); caps: [rows] the positions its pages hold (None:
    every one it writes; none past them is written). Returns (kv, tokens)."""
    _, num_pages, page_size, _ = kv[0][0].shape
    rows = min(page_table.shape[0], tokens.shape[0])
    page_table, seq_lens, query_start = page_table[:rows], seq_lens[:rows], query_start[:rows + 1]
    chunk = _active_chunks(query_start, active)       # [rows] 1 + request i's drafts (past num_seqs: 0)
    last = seq_lens - chunk                           # position L of its last token
    slots = row_slots[jnp.minimum(query_start[:-1], tokens.shape[0] - 1)]
    hidden = slot_rows(draft_hidden, slots)
    first = draft.head.apply({"params": draft_params}, hidden, method=Eagle3Head.propose)

    def body(carry, j):
        kv, x, hidden = carry
        lens = jnp.where((j + 1 < chunk) & _within(last + j - 1, caps), last + j, 0)   # writes L + j - 1 (lens - 1)
        meta = AttentionMetadata(slot_mapping=decode_slots(page_table, lens, page_size, num_pages),
                                 page_table=page_table, seq_lens=lens)
        embeds = _eagle_embed(draft, draft_params, model, params, x)
        hidden, kv = draft.head.apply({"params": draft_params}, embeds, hidden, jnp.maximum(lens - 1, 0), kv, meta)
        proposed = draft.head.apply({"params": draft_params}, hidden, method=Eagle3Head.propose)
        return (kv, proposed, hidden), proposed

    proposed = first[None]
    if draft.num_tokens > 1:
        (kv, _, _), more = jax.lax.scan(body, (kv, first, hidden), jnp.arange(1, draft.num_tokens))
        proposed = jnp.concatenate([proposed, more])   # [k, rows]
    return kv, _fill_drafts(proposed, tokens, query_start, num_seqs)


def accepted_rows(tokens, sampled, query_start, num_seqs, max_drafts: int):
    """[R] the row of each request's last accepted token in a verify step (its first row + the drafts accepted
    before the first that differs from the token sampled ahead of it: speculative.num_accepted's rule), and [R]
    whether request i is one (i < num_seqs)."""
    requests = min(query_start.shape[0] - 1, tokens.shape[0])
    start, chunk = query_start[:requests], query_start[1:requests + 1] - query_start[:requests]
    j = jnp.arange(max_drafts)[None, :]
    at = jnp.minimum(start[:, None] + j, tokens.shape[0] - 2)
    match = (j + 1 < chunk[:, None]) & (tokens[at + 1] == sampled[at])
    accepted = jnp.cumprod(match.astype(jnp.int32), axis=1).sum(axis=1)
    return jnp.minimum(start + accepted, tokens.shape[0] - 1), jnp.arange(requests) < num_seqs


def _active_chunks(query_start, active):
    """[rows] each request's rows in a verify step (0 for one that `active` [rows] leaves out)."""
    chunk = query_start[1:] - query_start[:-1]
    return chunk if active is None else jnp.where(active, chunk, 0)


def _within(positions, caps):
    return True if caps is None else positions < caps


def propose(draft: Draft, draft_params, kv, tokens, page_table, seq_lens, query_start, num_seqs, active=None,
            caps=None):
    """A draft model's greedy drafts, filled into a verify step's rows: request i's chunk (pack_verify) is its last
    token, then rows that hold draft j at offset j. num_tokens + 1 decode iterations of the draft over the requests:
    iteration j takes the token at position last + j (the last token, then draft j) and proposes
    draft j + 1; the last iteration only writes its input's K/V, so the draft's cache ends covering every position
    the verify writes. A request's iterations past its own chunk are padding (no K/V write), and so are all of an
    inactive one's (active, caps: as `eagle_propose`'s). Returns (kv, tokens with the drafts in place)."""
    _, num_pages, page_size, _ = kv[0][0].shape
    # a request has one row at least: no more requests than the step's rows (a 256-slot engine's 16-token verify
    # runs the draft over 16 rows, not 256)
    rows = min(page_table.shape[0], tokens.shape[0])
    page_table, seq_lens, query_start = page_table[:rows], seq_lens[:rows], query_start[:rows + 1]
    chunk = _active_chunks(query_start, active)       # [rows] request i's rows: 1 + its drafts (past num_seqs: 0)
    first = seq_lens - chunk                          # the position of its last token
    last = tokens[jnp.minimum(query_start[:-1], tokens.shape[0] - 1)]

    def body(carry, j):
        kv, x = carry
        lens = jnp.where((j < chunk) & _within(first + j, caps), first + j + 1, 0)
        meta = AttentionMetadata(slot_mapping=decode_slots(page_table, lens, page_size, num_pages),
                                 page_table=page_table, seq_lens=lens)
        hidden, kv = draft.model.apply({"params": draft_params}, x, jnp.maximum(lens - 1, 0), kv, meta)
        logits = draft.model.apply({"params": draft_params}, hidden, method=Transformer.logits)
        proposed = jnp.argmax(logits[:, :draft.vocab], axis=-1).astype(jnp.int32)
        return (kv, proposed), proposed

    (kv, _), proposed = jax.lax.scan(body, (kv, last), jnp.arange(draft.num_tokens + 1))   # [k + 1, rows]
    return kv, _fill_drafts(proposed[:draft.num_tokens], tokens, query_start, num_seqs)


def _fill_drafts(proposed, tokens, query_start, num_seqs):
    """tokens with each request's rows after its first (pack_verify's reserved rows) holding its drafts:
    proposed [k, requests], draft j of request i at proposed[j, i]."""
    k, rows = proposed.shape
    seq = token_sequences(query_start[:rows + 1], tokens.shape[0])
    at = jnp.minimum(seq, rows - 1)
    offset = jnp.arange(tokens.shape[0]) - query_start[at]
    fill = (seq < num_seqs) & (offset >= 1)
    return jnp.where(fill, proposed[jnp.clip(offset - 1, 0, k - 1), at], tokens)

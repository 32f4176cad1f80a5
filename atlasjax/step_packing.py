"""A scheduled step packed into the fixed bucket shapes of the jitted steps (numpy, no jax).

`pack_prefill` lays the step's prompt chunks end to end in a bucket of `num_tokens` rows with their
attention metadata (positions, KV slots, page tables, per-sequence lengths and offsets);
`pack_decode` puts one running sequence per row of a decode bucket. Both also return each row's
sampling settings, in the order `sampling.pack_rows` takes them.
"""
from __future__ import annotations

import numpy as np

from atlasjax.scheduler_output import SchedulerOutput


def sampling_row(req) -> tuple:
    return (req.params, req.seed, req.num_generated, req.eos_token_ids)


def _ragged(num_tokens: int, num_slots: int, page_size: int, num_pages: int, pages_per_seq: int,
            num_seqs: int) -> dict[str, np.ndarray]:
    """The attention metadata of chunks laid end to end (padding tokens write to the out-of-range KV slot
    num_pages * page_size), empty; `_place` fills in one chunk."""
    t, s = num_tokens, num_slots
    return dict(tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
                slot_mapping=np.full(t, num_pages * page_size, np.int32),
                page_table=np.zeros((s, pages_per_seq), np.int32), seq_lens=np.zeros(s, np.int32),
                query_start=np.zeros(s + 1, np.int32), num_seqs=np.int32(num_seqs))


def _place(b: dict, i: int, row: int, pages: list[int], start: int, tokens, page_size: int) -> int:
    """Sequence i's chunk of `tokens` at positions start onwards, from batch row `row`; returns the next row."""
    n, ps = len(tokens), page_size
    pos = np.arange(start, start + n)
    pages = np.asarray(pages, np.int32)
    b["tokens"][row:row + n] = tokens
    b["positions"][row:row + n] = pos
    b["slot_mapping"][row:row + n] = pages[pos // ps] * ps + pos % ps
    b["page_table"][i, :len(pages)] = pages
    b["seq_lens"][i] = start + n
    b["query_start"][i + 1:] = row + n
    return row + n


def pack_prefill(sched: SchedulerOutput, *, num_tokens: int, num_slots: int, page_size: int, num_pages: int,
                 pages_per_seq: int) -> tuple[dict[str, np.ndarray], list]:
    """Returns the prefill step's batch (padding tokens write to the out-of-range KV slot
    num_pages * page_size) and its sampling rows [num_slots] (None past the chunks)."""
    t, s = num_tokens, num_slots
    b = _ragged(t, s, page_size, num_pages, pages_per_seq, len(sched.prefills))
    b.update(sample_rows=np.zeros(s, np.int32), slot_ids=np.zeros(s, np.int32), commit=np.zeros(s, bool),
             next_tokens=np.full(t, -1, np.int32))
    rows, row = [None] * s, 0
    for i, c in enumerate(sched.prefills):
        req, n = c.request, c.num_tokens
        assert not req.num_pending_tokens, "a prefilling request has no token on the device"
        ids = req.all_token_ids
        b["sample_rows"][i] = row + n - 1
        b["slot_ids"][i] = req.slot
        b["commit"][i] = c.completes_prompt
        nxt = ids[c.start + 1:c.start + n + 1]
        b["next_tokens"][row:row + len(nxt)] = nxt
        rows[i] = sampling_row(req)
        row = _place(b, i, row, req.pages, c.start, ids[c.start:c.start + n], page_size)
    return b, rows


def pack_decode(sched: SchedulerOutput, pending_rows: dict, *, num_rows: int, num_slots: int,
                pages_per_seq: int) -> tuple[dict[str, np.ndarray], list]:
    """Row r runs sched.decodes[r]. A request whose last token is still on the device (sampled by the step
    in flight at row `pending_rows[req]`) gets token -1 - that row: the step gathers it there.
    Returns tokens, page_table, seq_lens, slots (padding rows: num_slots, out of range) and row_steps
    (each row's decode iterations), and the sampling rows [num_rows]."""
    n = num_rows
    b = dict(tokens=np.zeros(n, np.int32), page_table=np.zeros((n, pages_per_seq), np.int32),
             seq_lens=np.zeros(n, np.int32), slots=np.full(n, num_slots, np.int32), row_steps=np.ones(n, np.int32))
    rows = [None] * n
    for r, req in enumerate(sched.decodes):
        b["tokens"][r] = -1 - pending_rows[req] if req.num_pending_tokens else req.all_token_ids[-1]
        b["page_table"][r, :len(req.pages)] = req.pages
        b["seq_lens"][r] = req.num_total_tokens
        b["slots"][r] = req.slot
        b["row_steps"][r] = sched.steps.get(req, 1)
        rows[r] = sampling_row(req)
    return b, rows


def pack_verify(sched: SchedulerOutput, pending_rows: dict, *, num_tokens: int, num_slots: int, page_size: int,
                num_pages: int, pages_per_seq: int, shift_rows: dict | None = None
                ) -> tuple[dict[str, np.ndarray], list, list[tuple[int, int, int]]]:
    """A speculative verify step (steps.verify_step): request r of sched.decodes is a chunk of its last token and
    its drafts at positions num_total_tokens - 1 onwards, laid end to end as prefill chunks are; a last token
    still on the device is -1 - its row in the step in flight, as in `pack_decode`. Every row is sampled: row j
    of a chunk with the request's settings at output index num_generated + j (its seed stream and min_tokens),
    and its slot (`row_slots`; padding rows num_slots, out of range). Per request, for verify rounds: the tokens
    its max_tokens leaves (`budgets`), the positions its pages hold (`caps`) and `shift_from`.
    shift_rows: {request: its index in the verify launch in flight} for a pipelined launch (verify_rounds.py):
    such a request is packed from the tokens known now (position num_tokens - 1, output index and budget from
    its known outputs), and the step moves it along by what that launch emits for it (shift_from; else -1).
    Returns the batch, the sampling rows [num_tokens] and each request's (first row, number of drafts, positions
    its pages hold from its packed last token's on)."""
    t, shift_rows = num_tokens, shift_rows or {}
    b = _ragged(t, num_slots, page_size, num_pages, pages_per_seq, len(sched.decodes))
    b["row_slots"] = np.full(t, num_slots, np.int32)
    b["budgets"], b["caps"] = np.zeros(num_slots, np.int32), np.zeros(num_slots, np.int32)   # verify rounds'
    b["shift_from"] = np.full(num_slots, -1, np.int32)
    rows, spans, row = [None] * t, [], 0
    for i, req in enumerate(sched.decodes):
        shifted = req in shift_rows
        # tokens before the chunk's first row, and output tokens, as known to the device at this launch's start
        num_before = req.num_tokens if shifted else req.num_total_tokens
        generated = len(req.output_token_ids) if shifted else req.num_generated
        b["budgets"][i], b["caps"][i] = req.max_tokens - generated, len(req.pages) * page_size
        if shifted:
            b["shift_from"][i] = shift_rows[req]
        drafts = sched.drafts.get(req, [])
        n = 1 + len(drafts)
        if req.num_pending_tokens:
            last = -1 - pending_rows[req]
        else:
            last = req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
        b["row_slots"][row:row + n] = req.slot
        params, seed, _, eos = sampling_row(req)
        rows[row:row + n] = [(params, seed, generated + j, eos) for j in range(n)]
        spans.append((row, len(drafts), len(req.pages) * page_size - num_before + 1))
        row = _place(b, i, row, req.pages, num_before - 1, [last, *drafts], page_size)
    return b, rows, spans

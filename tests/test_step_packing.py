"""The host side of a step without jax: packing into bucket shapes and the stop-string search."""
import numpy as np

from atlasjax.output_processor import find_stop
from atlasjax.request import Request
from atlasjax.sampling_params import SamplingParams
from atlasjax.scheduler_output import PrefillChunk, SchedulerOutput
from atlasjax.step_packing import pack_decode, pack_prefill


def _request(prompt, pages, slot, outputs=()):
    req = Request("r", list(prompt), SamplingParams(), seed=0, max_tokens=8)
    req.pages, req.slot, req.output_token_ids = list(pages), slot, list(outputs)
    return req


def test_prefill_chunks_lie_end_to_end_with_their_kv_slots():
    a = _request(range(10, 15), pages=[3, 1], slot=2)            # 5 tokens, pages of 4: positions 0-3, 4
    b = _request(range(20, 26), pages=[0, 5], slot=0)            # its second chunk: positions 4-5
    sched = SchedulerOutput([], [PrefillChunk(a, 0, 5), PrefillChunk(b, 4, 2)], [], [])
    batch, rows = pack_prefill(sched, num_tokens=16, num_slots=4, page_size=4, num_pages=6, pages_per_seq=3)
    assert batch["tokens"][:7].tolist() == [10, 11, 12, 13, 14, 24, 25]
    assert batch["positions"][:7].tolist() == [0, 1, 2, 3, 4, 4, 5]
    assert batch["slot_mapping"][:7].tolist() == [12, 13, 14, 15, 4, 20, 21]
    assert (batch["slot_mapping"][7:] == 6 * 4).all(), "padding writes go to the out-of-range slot"
    assert batch["query_start"].tolist() == [0, 5, 7, 7, 7]
    assert batch["seq_lens"][:2].tolist() == [5, 6] and batch["sample_rows"][:2].tolist() == [4, 6]
    assert batch["slot_ids"][:2].tolist() == [2, 0] and batch["commit"][:2].tolist() == [True, True]
    assert batch["next_tokens"][:7].tolist() == [11, 12, 13, 14, -1, 25, -1]   # teacher tokens for prompt logprobs
    assert rows[2:] == [None, None] and rows[0][0] is a.params


def test_decode_rows_gather_pending_tokens_by_their_row():
    ready = _request([1, 2, 3], pages=[7], slot=1, outputs=[9])
    pending = _request([4, 5], pages=[2], slot=3)
    pending.num_pending_tokens = 1                                # sampled at row 10 of the step in flight
    sched = SchedulerOutput([ready, pending], [], [], [], steps={pending: 4})
    b, rows = pack_decode(sched, {pending: 10}, num_rows=8, num_slots=4, pages_per_seq=2)
    assert b["tokens"][:2].tolist() == [9, -11]
    assert b["seq_lens"][:2].tolist() == [4, 3]
    assert b["slots"].tolist() == [1, 3] + [4] * 6, "padding rows get an out-of-range slot"
    assert b["row_steps"][:2].tolist() == [1, 4]
    assert np.array_equal(b["page_table"][:2], [[7, 0], [2, 0]]) and rows[2:] == [None] * 6


def test_find_stop_takes_the_earliest_stop_past_the_checked_text():
    assert find_stop("abc STOP x END", ["END", "STOP"], prev_len=0) == (4, "STOP")
    # "STOP" ended before prev_len: checked at an earlier token already
    assert find_stop("abc STOP x END", ["END", "STOP"], prev_len=10) == (11, "END")
    # a stop string that straddles the old and the new text is found
    assert find_stop("abc ST", ["STOP"], prev_len=4) is None
    assert find_stop("abc STOP", ["STOP"], prev_len=6) == (4, "STOP")

"""Scheduler and page pool on their own (plain Python, no jax)."""
import sys

from atlasjax.page_pool import PagePool
from atlasjax.request import Request
from atlasjax.sampling_params import SamplingParams
from atlasjax.scheduler import Scheduler


def _req(rid, n_prompt, max_tokens=8):
    return Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=max_tokens), 0, max_tokens)


def _sched(num_pages=16, page_size=4, max_num_seqs=4, budget=16, caching=True):
    return Scheduler(PagePool(num_pages, page_size, caching), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget)


def test_no_jax_import():
    assert "atlasjax.scheduler" in sys.modules and "jax" not in {m.split(".")[0] for m in
                                                                  ("atlasjax.page_pool", "atlasjax.scheduler")}


def test_chunked_prefill_splits_a_long_prompt_and_decodes_keep_flowing():
    s = _sched(budget=8)
    a = _req("a", 3)
    s.add(a)
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.prefills] == [("a", 0, 3)]
    a.num_computed_tokens = 3
    a.output_token_ids.append(1)
    b = _req("b", 20)
    s.add(b)
    out = s.schedule()
    assert out.decodes == [a] and [(c.start, c.num_tokens) for c in out.prefills] == [(0, 7)]  # 8 - 1 decode token
    b.num_computed_tokens = 7
    out = s.schedule()
    assert out.decodes == [a] and [(c.start, c.num_tokens) for c in out.prefills] == [(7, 7)]


def test_preempts_the_newest_when_pages_run_out():
    s = _sched(num_pages=4, page_size=4, budget=64)
    a, b = _req("a", 7), _req("b", 7)
    s.add(a)
    s.add(b)
    s.schedule()
    for r in (a, b):
        r.output_token_ids += [1, 1]      # 9 tokens, 8 computed: both pages of each request are full
        r.num_computed_tokens = 8
    out = s.schedule()
    # each needs a 3rd page for token 9 but none is free: b (newest) gives way, a proceeds
    assert out.preempted == [b] and out.decodes == [a] and s.waiting[0] is b and b.num_computed_tokens == 0
    s.finish(a, "stop")
    assert s.pool.num_free_pages == 4 and sorted(s.free_slots) == [0, 1, 2, 3]


def test_prefix_pages_are_shared_and_reference_counted():
    s = _sched(num_pages=16, page_size=4)
    a = _req("a", 10)
    s.add(a)
    s.schedule()
    a.num_computed_tokens = 10
    b = _req("b", 10)
    s.add(b)
    out = s.schedule()
    assert b.num_cached_tokens == 8 and b.pages[:2] == a.pages[:2]
    assert [(c.start, c.num_tokens) for c in out.prefills if c.request is b] == [(8, 2)]
    assert s.pool.ref_counts[a.pages[0]] == 2
    s.finish(a, "stop")
    s.finish(b, "stop")
    assert s.pool.num_free_pages == 16 and all(c == 0 for c in s.pool.ref_counts)
    assert len(s.pool.cached) == 2      # content stays cached until evicted


def test_lru_eviction_reuses_oldest_cached_pages():
    pool = PagePool(4, 2)
    pages = pool.allocate(4)
    keys = pool.extend_keys([], [1, 2, 3, 4, 5, 6, 7, 8])
    pool.register(pages, keys, 0, 4)
    pool.free(pages)
    assert pool.lookup(keys[:2]) == pages[:2]            # hit
    pool.free(pages[:2])
    new = pool.allocate(1)                                # evicts the least recently freed cached page
    assert new[0] not in pool.page_key and len(pool.cached) == 3


def _dispatch(s, out):
    """What the engine does when it launches a step: pending tokens for the rows that sample one."""
    for req in out.decodes + [c.request for c in out.prefills if c.completes_prompt]:
        req.num_pending_tokens += 1
    s.dispatched(out)


def _complete(s, out, token=1):
    s.completed(out)
    for req in out.decodes + [c.request for c in out.prefills if c.completes_prompt]:
        if not req.is_finished:
            req.num_pending_tokens -= 1
            req.output_token_ids.append(token)


def test_async_schedules_the_next_decode_before_the_pending_token_is_known():
    s = _sched(page_size=4)
    a = _req("a", 4, max_tokens=3)
    s.add(a)
    first = s.schedule()
    _dispatch(s, first)
    second = s.schedule()          # step 1 not read back: a's first token is pending
    assert second.decodes == [a] and a.num_computed_tokens == 5 and len(a.pages) == 2   # a page for the pending token
    _dispatch(s, second)
    _complete(s, first)
    assert a.output_token_ids == [1] and a.num_pending_tokens == 1 and a.num_total_tokens == 6
    third = s.schedule()
    assert third.decodes == [a] and a.num_computed_tokens == 6
    _dispatch(s, third)
    _complete(s, second)
    assert s.schedule().is_empty   # its third token (pending) is its last: nothing more to compute
    # Retired: slot free for the next request now, pages once the step sampling that token completes.
    assert a not in s.running and sorted(s.free_slots) == [0, 1, 2, 3] and a.release_pending and a.pages
    _complete(s, third)
    s.finish(a, "length")
    assert a.output_token_ids == [1, 1, 1] and s.pool.num_free_pages == 16 and not s.has_work


def test_a_request_finished_while_in_flight_keeps_its_pages_until_the_step_completes():
    s = _sched(num_pages=4, page_size=4)
    a = _req("a", 4)
    s.add(a)
    first = s.schedule()
    _dispatch(s, first)
    second = s.schedule()
    _dispatch(s, second)
    _complete(s, first)
    s.finish(a, "stop")                          # step 1's token was a stop token; step 2 still writes a's pages
    assert a.is_finished and a not in s.running and s.pool.num_free_pages == 2 and a.pages
    assert sorted(s.free_slots) == [0, 1, 2, 3]  # the slot is free at once (the next admit resets its row)
    _complete(s, second)
    assert s.pool.num_free_pages == 4 and sorted(s.free_slots) == [0, 1, 2, 3] and a.output_token_ids == [1]


def test_preemption_counts_the_pending_tokens():
    s = _sched(num_pages=4, page_size=4, budget=64)
    a, b = _req("a", 7), _req("b", 7)
    s.add(a)
    s.add(b)
    first = s.schedule()
    _dispatch(s, first)                          # 2 pages each, first tokens pending
    second = s.schedule()                        # the pending token 8 still fits in page 2
    assert second.decodes == [a, b] and not second.preempted
    _dispatch(s, second)
    _complete(s, first)
    third = s.schedule()                         # 8 known + 1 pending: each needs a 3rd page, b gives way
    assert third.preempted == [b] and third.decodes == [a] and len(a.pages) == 3
    assert b.num_pending_tokens == 1 and s.waiting[0] is b and not b.pages


def test_a_waiting_request_is_not_admitted_while_its_token_is_on_the_device():
    s = _sched()
    a = _req("a", 5)
    a.num_pending_tokens = 1       # preempted while a dispatched step was still sampling for it
    s.add(a)
    assert s.schedule().is_empty
    a.num_pending_tokens = 0
    a.output_token_ids.append(1)
    assert [(c.start, c.num_tokens) for c in s.schedule().prefills] == [(0, 6)]   # prompt + the token, recomputed


def _decoding(s, rid, n_prompt, max_tokens=8):
    """A request admitted and prefilled: its first output token is known, decodes come next."""
    r = _req(rid, n_prompt, max_tokens)
    s.add(r)
    s.schedule()
    r.output_token_ids.append(1)
    return r


def test_multi_step_bounded_by_max_tokens_and_pages_without_preempting():
    s = Scheduler(PagePool(7, 4, False), max_num_seqs=4, max_num_batched_tokens=16, num_scheduler_steps=4)
    a, b = _decoding(s, "a", 3, max_tokens=3), _decoding(s, "b", 7, max_tokens=20)
    out = s.schedule()
    # a: 2 tokens left (max_tokens 3, one generated): 5 tokens, 2 pages; b: 8 tokens, 4 steps: 11, 3 pages
    assert out.decodes == [a, b] and out.steps == {a: 2, b: 4} and out.num_steps == 4
    assert (a.num_computed_tokens, b.num_computed_tokens) == (4 + 2 - 1, 8 + 4 - 1)
    assert not out.preempted and s.pool.num_free_pages == 7 - 2 - 3
    c = _decoding(s, "c", 7, max_tokens=20)        # takes the last 2 pages: no room for c's extra steps
    assert s.pool.num_free_pages == 0
    c.num_computed_tokens = 7
    out = s.schedule()
    assert c in out.decodes and c not in out.steps and not out.preempted


def test_multi_step_only_when_nothing_waits_for_a_free_slot():
    s = Scheduler(PagePool(32, 4, False), max_num_seqs=2, max_num_batched_tokens=16, num_scheduler_steps=4)
    a = _decoding(s, "a", 3)
    assert s.schedule().steps == {a: 4}
    a.num_computed_tokens, a.output_token_ids = 4, [1]         # (as if read back: one generated token)
    s.add(_req("b", 5))                                         # a free slot can take b: prefill, one step
    out = s.schedule()
    assert out.prefills and out.steps == {}
    s.add(_req("c", 5))                                         # both slots busy: c cannot start anyway
    b = out.prefills[0].request
    b.output_token_ids.append(1)
    out = s.schedule()
    assert not out.prefills and out.steps and len(s.waiting) == 1


def test_a_step_with_a_prompt_logprob_chunk_keeps_to_the_cap_while_others_decode():
    s = Scheduler(PagePool(64, 4, False), max_num_seqs=4, max_num_batched_tokens=32, prompt_logprobs_tokens=8)
    d = _decoding(s, "d", 3, max_tokens=100)
    lp = Request("lp", list(range(100, 130)), SamplingParams(max_tokens=2, prompt_logprobs=1), 0, 2)
    plain = _req("plain", 25)
    s.add(lp)
    s.add(plain)
    lp_chunks, prefill_tokens = [], []
    while plain.is_prefilling or lp.is_prefilling:
        out = s.schedule()
        assert d in out.decodes                              # the decode runs in every step
        total = sum(c.num_tokens for c in out.prefills)
        if any(c.request is lp for c in out.prefills):
            assert total <= 8
        lp_chunks += [(c.start, c.num_tokens) for c in out.prefills if c.request is lp]
        prefill_tokens.append(total)
        _dispatch(s, out)
        _complete(s, out)
    # lp's prompt in chunks of at most 8, each position once and in order
    assert [start for start, _ in lp_chunks] == [sum(n for _, n in lp_chunks[:i]) for i in range(len(lp_chunks))]
    assert sum(n for _, n in lp_chunks) == 30 and max(n for _, n in lp_chunks) <= 8 and len(lp_chunks) > 1
    assert max(prefill_tokens) > 8                           # without a prompt-logprob chunk, the budget applies

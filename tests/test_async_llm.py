"""AsyncLLM's delivery of deltas to asyncio streams: grouped per event loop, and a closed loop's
streams aborted instead of taking the engine thread down."""
from __future__ import annotations

import asyncio
import threading
import time

from atlasjax import LLM, SamplingParams
from atlasjax.async_llm import AsyncLLM
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from tests.test_engine import _assert_idle

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["w5 w6 w7", "w9 w1", "w3 w3 w3 w4", "w11"]


def _engine(tiny):
    return LLMEngine(EngineConfig(max_num_seqs=8, max_model_len=64, page_size=8, num_pages=65,
                                  max_num_batched_tokens=64), loaded=tiny)


async def _texts(llm: AsyncLLM, prompts) -> list[str]:
    async def one(p):
        return "".join([d.new_text async for d in llm.generate(p, PARAMS)])
    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _wait_idle(engine, timeout=30.0):
    end = time.monotonic() + timeout
    while (engine.has_unfinished() or engine.pool.num_free_pages != engine.pool.num_pages) and time.monotonic() < end:
        time.sleep(0.05)


def test_streams_on_two_event_loops_get_their_own_deltas(tiny):
    want = [o.outputs[0].text for o in LLM.from_engine(_engine(tiny)).generate(PROMPTS, PARAMS)]
    llm = AsyncLLM(engine=_engine(tiny))
    got = {}

    def run(name, prompts):   # each thread runs its own event loop against the one engine thread
        got[name] = asyncio.run(_texts(llm, prompts))
    threads = [threading.Thread(target=run, args=(i, PROMPTS[i::2])) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        llm.shutdown()
    assert got[0] == want[0::2] and got[1] == want[1::2]


def test_a_closed_event_loop_aborts_its_streams_and_the_engine_serves_on(tiny):
    engine = _engine(tiny)
    llm = AsyncLLM(engine=engine)
    try:
        loop = asyncio.new_event_loop()
        stream = llm.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        first = loop.run_until_complete(stream.__anext__())   # the request is running ...
        assert first.new_token_ids
        loop.close()                                          # ... and nobody will read it again
        _wait_idle(engine)
        assert llm.is_healthy                                 # the engine thread is still up
        _assert_idle(engine)                                  # the orphaned request was aborted
        assert asyncio.run(_texts(llm, PROMPTS[:2])) == \
            [o.outputs[0].text for o in LLM.from_engine(_engine(tiny)).generate(PROMPTS[:2], PARAMS)]
    finally:
        llm.shutdown()


def test_queued_commands_that_are_not_requests_do_not_fill_the_waiting_queue(tiny):
    """Only requests count against max_waiting: a step that finishes many requests queues as many releases, and
    those must not turn the next submissions away as "queue full" (run-batch saw 256 of 1,024 refused so)."""
    import pytest
    from atlasjax.errors import QueueFullError
    llm = AsyncLLM(engine=_engine(tiny), max_waiting=3)
    try:
        with llm._wake:        # the engine thread cannot take the inbox while this is held
            llm._inbox.extend([("reset_prefix_cache", f"c{i}") for i in range(8)])
            llm._check_capacity()                          # eight commands, no request: room
            llm._inbox.extend([("add", f"r{i}", [1], PARAMS, 0, None, None) for i in range(3)])
            with pytest.raises(QueueFullError):
                llm._check_capacity()                      # three requests on their way: full
            for _ in range(3):                             # (they were never submitted through generate)
                llm._inbox.pop()
        assert asyncio.run(_texts(llm, PROMPTS[:2]))       # it serves on
    finally:
        llm.shutdown()


def test_the_capacity_check_is_safe_while_other_threads_fill_and_empty_the_inbox(tiny):
    """The check counts the inbox while the engine thread empties it and other event loops' threads add to it
    (it once iterated it unlocked: one of 1,024 run-batch requests got a 500, "deque mutated during iteration")."""
    llm = AsyncLLM(engine=_engine(tiny), max_waiting=10_000)
    stop = threading.Event()

    def fill():
        while not stop.is_set():
            for i in range(64):
                llm._submit(("reset_prefix_cache", f"c{i}"))
    filler = threading.Thread(target=fill)
    filler.start()
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            llm._check_capacity()
    finally:
        stop.set()
        filler.join()
        llm.shutdown()


def test_a_draining_shutdown_finishes_the_requests_a_pause_held(tiny):
    """A server stopping gracefully while paused: the requests a pause kept or held are not left hanging."""
    want = [o.outputs[0].text for o in LLM.from_engine(_engine(tiny)).generate(PROMPTS[:2], PARAMS)]
    llm = AsyncLLM(engine=_engine(tiny))

    async def run():
        assert await llm.pause_generation("keep") and await llm.is_paused()
        streams = asyncio.gather(*(_texts(llm, [p]) for p in PROMPTS[:2]))
        await asyncio.sleep(0.3)
        assert llm.engine.scheduler.held and not llm.engine.scheduler.running
        await asyncio.to_thread(llm.shutdown, True, 60)
        return [texts[0] for texts in await asyncio.wait_for(streams, 30)]
    assert asyncio.run(run()) == want

"""serving/streams.py: merged streams and a stream cut off by an event leave nothing running, however they end:
each engine stream must be closed (its request aborted, its pages freed) when its consumer stops."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from serving.streams import merge, until_set


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "merged"])
@pytest.mark.parametrize("how", ["cancel", "stop", "break", "end"])
def test_until_set_closes_its_stream_however_it_ends(how, alone):
    async def run():
        closed = []

        async def numbers(n):
            try:
                for i in range(n):
                    await asyncio.sleep(0.005)
                    yield i
            finally:
                closed.append(True)
        stop, got = asyncio.Event(), []

        async def consume():
            streams = [until_set(numbers(5 if how == "end" else 1000), stop)] + ([] if alone else [numbers(2)])
            async with contextlib.aclosing(merge(streams)) as merged:
                async for _, item in merged:
                    got.append(item)
                    if how == "break" and len(got) == 3:
                        break
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        if how == "cancel":
            task.cancel()
        elif how == "stop":
            stop.set()
        await asyncio.gather(task, return_exceptions=True)
        return closed, got, task.cancelled(), [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    closed, got, cancelled, left = asyncio.run(run())
    assert closed == [True] * (1 if alone else 2) and not left     # every stream closed, no task left behind
    assert cancelled == (how == "cancel")
    if how == "end":
        assert sorted(got) == ([0, 1, 2, 3, 4] if alone else [0, 0, 1, 1, 2, 3, 4])

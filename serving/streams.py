"""Merging async streams: items of several async iterators as they arrive, tagged with the index of
their iterator. Leaving the merged iterator (or an error in any stream) closes every stream at once,
which for engine streams aborts their requests and frees their pages."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    if len(streams) == 1:
        # aclosing: leaving this generator early must close (abort) the stream at once, not at GC
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((i, item))
            queue.put_nowait((i, None))
        except BaseException as e:  # noqa: BLE001 (handed to the consumer)
            queue.put_nowait((i, e))
            raise

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:       # cancelling a pump leaves its stream, which closes it
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:   # streams whose pump never started are closed too
            await stream.aclose()


async def until_set(stream: AsyncIterator, stop: asyncio.Event) -> AsyncIterator:
    """The items of `stream` until `stop` is set; then the stream is closed (an engine stream: its request is
    aborted and its pages freed) and this iterator ends, as if the stream had. Leaving it early (a consumer
    closing it, a cancellation) closes the stream too."""
    waiter = asyncio.ensure_future(stop.wait())
    step = None
    try:
        while not stop.is_set():
            step = asyncio.ensure_future(stream.__anext__())
            await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        waiter.cancel()
        if step is not None and not step.done():    # the stream is inside __anext__: cancelling ends it there
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await stream.aclose()

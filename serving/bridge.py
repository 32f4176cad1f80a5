"""The bridge from request handlers to AsyncLLM: submit, stream, collect, notice disconnects.

A handler describes its work as `Job`s (one engine request each: a tokenized prompt and its
SamplingParams, n completions). `stream_jobs` merges their deltas into one async iterator of
(job index, StreamDelta), recording TTFT / inter-token latency / token counts on the way.
Leaving that iterator (client gone, error, cancellation) leaves every engine iterator, and
AsyncLLM aborts what is unfinished, which frees its pages.

Errors must reach the client as an HTTP status, so handlers wait for the first delta before
sending headers (`first_delta`), racing it against the client disconnecting; non-streaming
handlers race the whole collection (`until_disconnect`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request

from atlasjax.outputs import Logprob, StreamDelta
from atlasjax.sampling_params import SamplingParams
from serving import request_log
from serving.errors import from_engine_error
from serving.streams import merge, until_set
from serving.thinking_budget import ThinkingBudget, budgeted


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


@dataclasses.dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    thinking_budget: ThinkingBudget | None = None   # serving/thinking_budget.py
    priority: int = 0                               # with --scheduling-policy priority: lower is served sooner
    lora_request: object = None                     # the LoRA adapter its "model" names (serving/lora_routes.py)
    cache_salt: str | None = None                   # vLLM's: prefix-cache pages shared only with the same salt
    stop: asyncio.Event | None = None               # set: the job's stream ends now, its request aborted


@dataclasses.dataclass
class Completion:
    """One finished sequence, accumulated from its deltas."""
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None    # prompt tokens the prefix cache served (its first delta's)

    def add(self, delta: StreamDelta) -> None:
        if self.num_cached_tokens is None:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.new_text
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.new_logprobs or []
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


async def stream_jobs(llm, jobs: list[Job], metrics) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Deltas of all jobs, merged; engine errors are raised as APIError."""
    start = time.perf_counter()
    last_token_time: dict[tuple[int, int], float] = {}
    first_token_time: dict[tuple[int, int], float] = {}
    num_tokens: dict[tuple[int, int], int] = {}
    finished: set[tuple[int, int]] = set()
    queued: dict[tuple[int, int], float] = {}
    failed = False
    if request_log.enabled():
        for job in jobs:
            request_log.submitted(job.request_id, len(job.prompt_ids), job.params, job.priority)
    merged = _merge(llm, jobs)
    try:
        async with contextlib.aclosing(merged):
            async for job_index, delta in merged:
                now = time.perf_counter()
                key = (job_index, delta.index)
                if delta.queue_seconds is not None and key not in queued:   # (a reasoning budget's
                    queued[key] = delta.queue_seconds                         # continuation queues again)
                    metrics.observe_queue(delta.queue_seconds)
                if delta.new_token_ids:
                    metrics.observe_token(now - last_token_time[key] if key in last_token_time else None,
                                          now - start, len(delta.new_token_ids))
                    last_token_time[key] = now
                    first_token_time.setdefault(key, now)
                    num_tokens[key] = num_tokens.get(key, 0) + len(delta.new_token_ids)
                if delta.finished and key not in finished:
                    finished.add(key)
                    metrics.observe_finish(delta.finish_reason or "stop", now - start)
                    if key in first_token_time:
                        metrics.observe_sequence(len(jobs[job_index].prompt_ids), num_tokens[key],
                                                 first_token_time[key] - start, now - start, queued.get(key))
                    if request_log.enabled():
                        request_log.finished(jobs[job_index].request_id, delta.index, delta.finish_reason or "stop",
                                             num_tokens.get(key, 0), first_token_time[key] - start
                                             if key in first_token_time else None, now - start)
                yield job_index, delta
    except Exception as e:  # noqa: BLE001 (everything the engine raises becomes an HTTP error)
        failed = True
        raise from_engine_error(e) from e
    finally:
        if last_token_time:     # the prompts were processed
            metrics.add_prompt_tokens(sum(len(job.prompt_ids) for job in jobs))
        if not failed:          # closed early: the client went away, and its sequences were aborted
            for _ in range(sum(job.params.n for job in jobs) - len(finished)):
                metrics.observe_finish("abort", None)
            if request_log.enabled():
                for j, job in enumerate(jobs):
                    left = job.params.n - sum(1 for key in finished if key[0] == j)
                    if left:
                        request_log.aborted(job.request_id, left, time.perf_counter() - start)


def _stream(llm, job: Job) -> AsyncIterator[StreamDelta]:
    if job.thinking_budget is not None:
        stream = budgeted(llm, job.prompt_ids, job.params, job.request_id, job.thinking_budget, job.priority,
                          job.lora_request, job.cache_salt)
    else:
        stream = llm.generate(job.prompt_ids, job.params, job.request_id, priority=job.priority,
                              lora_request=job.lora_request, cache_salt=job.cache_salt)
    return stream if job.stop is None else until_set(stream, job.stop)


def _merge(llm, jobs: list[Job]) -> AsyncIterator[tuple[int, StreamDelta]]:
    return merge([_stream(llm, job) for job in jobs])


async def wait_disconnect(request: Request) -> None:
    """Return when the client has disconnected (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable):
    """Await `work`, or cancel it and raise ClientDisconnected if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def first_delta(request: Request, deltas: AsyncIterator):
    """The first item of `deltas` (so errors become an HTTP status), or ClientDisconnected."""
    try:
        return await until_disconnect(request, deltas.__anext__())
    except ClientDisconnected:
        await deltas.aclose()
        raise


async def with_first(first, rest: AsyncIterator) -> AsyncIterator:
    """`first`, then the rest of the stream it was taken from (the caller closes `rest`)."""
    yield first
    async for item in rest:
        yield item


async def collect(deltas: AsyncIterator[tuple[int, StreamDelta]], num_jobs: int, n: int) -> list[list[Completion]]:
    """Drain a merged stream into completions[job][index]."""
    completions = [[Completion() for _ in range(n)] for _ in range(num_jobs)]
    async with contextlib.aclosing(deltas):
        async for job_index, delta in deltas:
            completions[job_index][delta.index].add(delta)
    return completions

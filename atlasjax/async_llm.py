"""AsyncLLM: the engine on its own thread, with an asyncio streaming API (what the server uses).

One thread owns the device and runs `LLMEngine.step()` whenever there is work. Callers on an
asyncio loop submit requests through a thread-safe inbox and receive `StreamDelta`s through a
per-request asyncio queue. Leaving the iterator early (client disconnect, cancellation) aborts
the request, which frees its pages and slot at the engine's next iteration.

`StreamingLLM` is the asyncio side alone; atlasjax/engine_process.py puts the same side in front
of an engine in a child process.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable

from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import AtlasJaxError, QueueFullError  # noqa: F401 (re-exported)
from atlasjax.generation_config import default_sampling_params
from atlasjax.lora import LoRARequest
from atlasjax.outputs import StreamDelta
from atlasjax.sampling_params import SamplingParams

log = logging.getLogger("atlasjax.async")


class StreamingLLM:
    """The asyncio side of an engine that runs elsewhere (a thread: AsyncLLM; a process:
    atlasjax.engine_process.EngineProcessLLM): per-request queues fed by `_deliver`, and commands
    ("add" / "abort" / "release" / "reset_prefix_cache"; "embed", "sleep", "wake_up", "is_sleeping", "start_profile",
    "stop_profile", "pause", "resume", "is_paused", "update_weights" answer once) sent through `_submit`, carried
    out in order."""

    def __init__(self):
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped serving (None while it runs)."""
        return self._error

    # ---- public API
    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults (atlasjax/generation_config.py), else SamplingParams()'s."""
        return default_sampling_params(self.engine.generation_defaults)

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[StreamDelta]:
        """Stream the deltas of one request (all n completions interleaved, by .index). priority, lora_request,
        cache_salt: see `LLMEngine.add_request` (priority only with the priority scheduling policy)."""
        if self._error is not None:
            raise RuntimeError(f"the engine failed: {self._error!r}")
        params = params or self.get_default_sampling_params()
        request_id = request_id or f"req-{next(self._ids)}"
        self._check_capacity()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._submit(("add", request_id, prompt, params, priority, lora_request, cache_salt))
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            self._streams.pop(request_id, None)
            # Finished: forget it. Not finished (consumer left): abort, which frees its pages.
            self._submit(("release" if remaining == 0 else "abort", request_id))

    async def embed(self, prompts: list, params, request_id: str | None = None) -> list:
        """`LLMEngine.embed` on the engine's side, between its steps: (token ids, vector) per prompt."""
        return (await self._call("embed", request_id or f"embd-{next(self._ids)}", prompts, params)).results

    async def sleep(self, level: int = 1) -> None:
        """`LLM.sleep` on the engine's side (atlasjax/sleep_mode.py), refused while requests are in flight."""
        await self._call("sleep", f"sleep-{next(self._ids)}", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", f"wake-{next(self._ids)}", tags)

    async def is_sleeping(self) -> bool:
        return await self._call("is_sleeping", f"sleeping-{next(self._ids)}")

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> bool:
        """vLLM's `pause_generation` (atlasjax/pause.py): "abort", "wait" for or "keep" the requests in flight;
        later ones wait for `resume_generation`. Answers once the pause has taken effect (True), or False when a
        resume called it off first."""
        return await self._call("pause", f"pause-{next(self._ids)}", mode, clear_cache)

    async def resume_generation(self) -> None:
        await self._call("resume", f"resume-{next(self._ids)}")

    async def is_paused(self) -> bool:
        return await self._call("is_paused", f"paused-{next(self._ids)}")

    async def update_weights_from_disk(self, model_path: str) -> dict:
        """`LLM.update_weights_from_disk` between the engine's steps (atlasjax/weight_update.py): refused while
        requests run, so pause first; {"model_path", "seconds"}."""
        return await self._call("update_weights", f"weights-{next(self._ids)}", model_path)

    async def start_profile(self, directory: str | None = None) -> str:
        """`LLM.start_profile` between the engine's steps (atlasjax/profiling.py); returns the trace's directory."""
        return await self._call("start_profile", f"profile-{next(self._ids)}", directory)

    async def stop_profile(self) -> str:
        return await self._call("stop_profile", f"profile-{next(self._ids)}")

    async def _call(self, kind: str, request_id: str, *args):
        """Send one command that answers once (an error is raised here) and wait for its answer."""
        if self._error is not None:
            raise RuntimeError(f"the engine failed: {self._error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._submit((kind, request_id, *args))
        try:
            item = await queue.get()
        finally:
            self._streams.pop(request_id, None)
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt pages no running request holds (vLLM's); requests submitted after this
        call compute their prompts again."""
        self._submit(("reset_prefix_cache", None))

    # ---- for subclasses
    def _check_capacity(self) -> None:
        """Raise QueueFullError when no more requests may wait (or leave it to the engine's side)."""

    def _submit(self, cmd) -> None:
        raise NotImplementedError

    def _orphaned(self, request_id: str) -> None:
        """Nobody will read this request's stream any more (its event loop closed): abort it."""
        self._submit(("abort", request_id))

    def _deliver(self, items) -> None:
        """(request id, delta or error) pairs to their streams: one wake-up per event loop, not one per
        item (each wake-up is a write to the loop's socket, and a GIL hand-over)."""
        puts: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, queue = target
                puts.setdefault(loop, []).append((request_id, queue, item))
        for loop, batch in puts.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:      # that event loop was closed: nobody will read these streams
                for request_id, _, _ in batch:
                    self._streams.pop(request_id, None)
                    self._orphaned(request_id)

    def _fail_all(self, error: BaseException) -> None:
        self._error = error
        self._deliver([(rid, RuntimeError(f"engine failure: {error!r}")) for rid in list(self._streams)])


class AsyncLLM(StreamingLLM):
    def __init__(self, model: str | None = None, *, max_waiting: int = 256, engine: LLMEngine | None = None,
                 **engine_kwargs):
        super().__init__()
        self.engine = engine or LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.max_waiting = max_waiting
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="atlasjax-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self):
        """The engine's counters, its gauges read now (they change on abort even when no step runs)."""
        self.engine.stats.refresh(self.engine)
        return self.engine.stats

    @property
    def is_healthy(self) -> bool:
        """False once the engine thread has died (the server then reports 503 on /health)."""
        return self._error is None and self._thread.is_alive()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the engine thread; with drain, after the in-flight requests finish."""
        with self._wake:
            self._stopping = "drain" if drain else "now"
            self._wake.notify()
        self._thread.join(timeout)

    # ---- engine thread
    def _check_capacity(self) -> None:
        # requests waiting now (the step's stats may be stale: an abort needs no step) and those on their way, not
        # the releases, aborts and other commands queued beside them (a step that ends many requests queues as many);
        # counted under the lock, as the engine thread empties the inbox and other event loops add to it
        with self._wake:
            arriving = sum(1 for cmd in self._inbox if cmd[0] == "add")
        if len(self.engine.scheduler.waiting) + arriving >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests are already waiting")

    def _submit(self, cmd) -> None:
        with self._wake:
            self._inbox.append(cmd)
            self._wake.notify()

    def _orphaned(self, request_id: str) -> None:
        self.engine.abort(request_id)   # frees its pages (_deliver runs on the engine thread)

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not self._inbox and not engine.has_unfinished() and not self._stopping:
                        self._wake.wait()
                    commands = list(self._inbox)
                    self._inbox.clear()
                    stopping = self._stopping
                apply_commands(engine, commands, self._deliver)
                if stopping == "drain" and engine.is_paused:
                    engine.resume_generation()    # the requests a pause kept or held finish too
                if commands:
                    engine.stats.refresh(engine)   # gauges stay true after aborts with no step
                if stopping == "now" or (stopping == "drain" and not engine.has_unfinished() and not self._inbox):
                    return
                if out := [(d.request_id, d) for d in engine.step()] + engine.pause_state.answers():
                    self._deliver(out)
        except BaseException as e:  # noqa: BLE001 (report to every waiter, then stop)
            log.exception("engine thread failed")
            self._fail_all(e)


def apply_commands(engine: LLMEngine, commands: list, deliver: Callable[[list], None]) -> None:
    """Carry out commands in order on the engine's thread and deliver their (request id, item) pairs; the
    embed commands among them run together (their inputs share batches: concurrent embedding requests cost
    one pass), each delivered as soon as its last batch lands."""
    out, embeds = [], []
    for cmd in commands:
        if cmd[0] == "embed":
            embeds.append(cmd)
        else:
            out += apply_command(engine, cmd)
    deliver(out)
    if not embeds:
        return
    sent = set()

    def done(i, result):
        sent.add(i)
        deliver([(embeds[i][1], result if isinstance(result, BaseException) else Embeddings(result))])
    try:
        engine.embed_requests([(cmd[2], cmd[3]) for cmd in embeds], on_done=done)
    except Exception as e:  # noqa: BLE001 (embedding leaves the engine's state alone: report it, keep serving)
        if not isinstance(e, AtlasJaxError):
            log.exception("embedding requests failed")
            e = RuntimeError(f"embedding failed: {type(e).__name__}: {e}")
        deliver([(cmd[1], e) for i, cmd in enumerate(embeds) if i not in sent])


def apply_command(engine: LLMEngine, cmd) -> list:
    """Carry out one command on the engine's thread; returns (request id, error) pairs to deliver."""
    kind, request_id = cmd[0], cmd[1]
    if kind == "add":
        try:
            engine.add_request(request_id, cmd[2], cmd[3], priority=cmd[4], lora_request=cmd[5], cache_salt=cmd[6])
        except AtlasJaxError as e:
            return [(request_id, e)]
    elif kind == "abort":
        engine.abort(request_id)
    elif kind == "release":
        engine.release(request_id)
    elif kind == "reset_prefix_cache":
        engine.pool.reset_prefix_cache()
    elif kind in ("sleep", "wake_up", "is_sleeping"):   # answered once, through the request id's queue
        from atlasjax import sleep_mode  # noqa: PLC0415
        try:
            if kind == "is_sleeping":
                return [(request_id, bool(engine.sleep_state.asleep))]
            getattr(sleep_mode, kind)(engine, cmd[2])
        except AtlasJaxError as e:
            return [(request_id, e)]
        return [(request_id, kind)]
    elif kind in ("pause", "resume", "is_paused", "update_weights"):
        return _pausing_command(engine, cmd)
    elif kind in ("start_profile", "stop_profile"):
        try:
            return [(request_id, engine.profiler.start(cmd[2]) if kind == "start_profile" else engine.profiler.stop())]
        except AtlasJaxError as e:
            return [(request_id, e)]
    return []


def _pausing_command(engine: LLMEngine, cmd) -> list:
    """A pause ("pause", id, mode, clear_cache: answered once it takes effect, after the deltas of the requests it
    ended), "resume", "is_paused" or "update_weights" (id, model path) command; (request id, item) pairs."""
    kind, request_id = cmd[0], cmd[1]
    try:
        if kind == "pause":
            deltas = engine.pause_generation(cmd[2], cmd[3])
            engine.pause_state.waiters.append(request_id)
            return [(d.request_id, d) for d in deltas] + engine.pause_state.answers()
        if kind == "resume":
            engine.resume_generation()
            return engine.pause_state.answers() + [(request_id, None)]
        if kind == "is_paused":
            return [(request_id, engine.is_paused)]
        return [(request_id, engine.update_weights_from_disk(cmd[2]))]
    except AtlasJaxError as e:
        return [(request_id, e)]


@dataclasses.dataclass
class Embeddings:
    """An embed command's answer on its way to the caller: (token ids, vector) per input."""
    results: list


def _put_all(batch) -> None:
    for _, queue, item in batch:
        queue.put_nowait(item)

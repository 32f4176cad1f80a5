"""The engine core in a process of its own (`EngineProcessLLM`; `serve --engine-process`).

An in-process server (AsyncLLM) runs the engine's step loop on a thread beside the HTTP event
loop, and the two share one interpreter lock: the engine thread drops it inside every native call
(the input copy, the launch) and must wait to take it back while the event loop streams a burst of
deltas (session 42, docs/performance.md). Here the engine runs in a child process with its own
interpreter: the server's process tokenizes, renders templates and speaks HTTP; the child
schedules, runs the device steps and detokenizes. One pipe joins them:

    parent -> child  ("add", request id, prompt, SamplingParams, priority, LoRARequest or None, cache salt or None) | ("abort", id) | ("release", id)
                     | ("stop", drain)
    child -> parent  ("ready", EngineInfo) or ("failed", error), once, at start;
                     ("out", [(request id, StreamDelta or error), ...], EngineStats) after each step
                     or batch of commands; ("died", error) if the step loop fails; ("stopped",) last.

The child is a fresh interpreter (a forked one would share CUDA and jax state), and it
owns the devices: the parent must not have initialized a GPU backend. A child that dies fails
every open stream and turns /health to 503; when the parent exits, the child's pipe closes and it
stops too.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from atlasjax.async_llm import StreamingLLM, apply_command, apply_commands
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import QueueFullError
from atlasjax.metrics import EngineStats

log = logging.getLogger("atlasjax.engine_process")

# jax settings a server process makes before its engine starts (atlasjax.compile_cache.enable), which a
# spawned child does not inherit
_JAX_SETTINGS = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size")


@dataclasses.dataclass
class EngineInfo:
    """What the server's process needs of the engine that runs in the child."""
    max_model_len: int
    model_config: Any
    weights_summary: str
    tokenizer: Any
    stats: EngineStats
    generation_defaults: Any     # atlasjax.generation_config.GenerationDefaults
    scheduling_policy: str       # fcfs | priority (atlasjax/waiting_queue.py)
    eos_token_ids: tuple[int, ...] = ()   # the model's end tokens (beam search completes a beam on them)
    classifier_labels: tuple[str, ...] = ()   # a sequence classifier's labels (/classify)
    pooling_only: bool = False    # a pooling runner (no generation)
    config: Any = None            # the engine's EngineConfig, as it resolved it (its LoRA rank, /get_server_info)

    def stop_followers(self) -> None:
        """Multi-host runs keep their engine in the server's process (EngineProcessLLM refuses them)."""


class EngineProcessLLM(StreamingLLM):
    """AsyncLLM's interface (generate, abort, shutdown, tokenizer, stats, is_healthy) over an engine
    running in a child process. Blocks until the child's engine is built (compiles included); a
    failure there is raised here as the child raised it (an AtlasJaxError for a bad model or config).

    setup: a picklable callable the child runs before it builds the engine (what a bench preset
    patches into the loader, say). env: variables set for the child alone (a data-parallel replica's
    CUDA_VISIBLE_DEVICES: atlasjax/data_parallel.py)."""

    def __init__(self, config: EngineConfig, *, max_waiting: int = 256, setup: Callable[[], None] | None = None,
                 env: dict[str, str] | None = None):
        super().__init__()
        import jax  # noqa: PLC0415
        settings = {name: getattr(jax.config, name) for name in _JAX_SETTINGS}
        self._conn, child_conn = multiprocessing.Pipe()
        # A fresh interpreter that imports only this module (multiprocessing's spawn would run the caller's
        # main script again), with the caller's import path; it reads its arguments from the pipe.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {})}
        self._process = subprocess.Popen(
            [sys.executable, "-c", f"from atlasjax.engine_process import child_main; child_main({child_conn.fileno()})"],
            pass_fds=(child_conn.fileno(),), env=env)
        child_conn.close()
        try:
            self._conn.send((config, max_waiting, setup, settings, logging.getLogger().level))
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._conn.close()
            raise RuntimeError(f"the engine process exited while starting (exit code {self._process.wait()})") \
                from None
        except BaseException:   # Ctrl-C while the engine builds: it ignores SIGINT, so end it here
            self._process.kill()
            self._process.wait()
            self._conn.close()
            raise
        if kind == "failed":
            self._process.wait()
            self._conn.close()
            raise payload
        self.engine: EngineInfo = payload
        self._stopping = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        # the event loop never writes to the pipe itself: a long prompt could fill it while the child runs a step
        self._writer = threading.Thread(target=self._write_loop, name="atlasjax-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="atlasjax-engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self) -> EngineStats:
        """The counters and gauges of the child's latest message."""
        return self.engine.stats

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._process.poll() is None

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the child; with drain, after the in-flight requests finish. Past `timeout` it is killed."""
        if self._process.poll() is None:
            self._stopping = True
            self._submit(("stop", drain))
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop in %s s; killing it", timeout)
                self._process.kill()
                self._process.wait()
        self._outbox.put(None)
        self._reader.join(5)

    # ---- the server's side of the pipe
    def _submit(self, cmd) -> None:
        self._outbox.put(cmd)

    def _write_loop(self) -> None:
        while (cmd := self._outbox.get()) is not None:
            try:
                self._conn.send(cmd)
            except (OSError, ValueError):   # the child is gone; the reader reports it
                return

    def _read_loop(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "out":
                    self.engine.stats = message[2]
                    self._deliver(message[1])
                elif kind == "died":
                    self._fail_all(message[1])
                elif kind == "stopped":
                    return
        except (EOFError, OSError):
            code = self._process.wait()
            if self._error is None and (not self._stopping or self._streams):
                self._fail_all(RuntimeError(f"the engine process exited (exit code {code})"))


def child_main(fd: int) -> None:
    """The engine process: read its arguments, build the engine, answer "ready", then run commands and
    steps until told to stop or until the server's end of the pipe closes."""
    conn = multiprocessing.connection.Connection(fd)
    # Ctrl-C and SIGTERM reach the whole process group: the server's process decides (it drains, then stops us)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="atlasjax-parent-watch", daemon=True).start()
    try:
        config, max_waiting, setup, settings, log_level = conn.recv()
        logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        import jax  # noqa: PLC0415
        for name, value in settings.items():
            jax.config.update(name, value)
        if setup is not None:
            setup()
        from atlasjax.engine import LLMEngine  # noqa: PLC0415
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 (sent to the server's process, which raises it)
        _send_if_open(conn, ("failed", _sendable(e)))
        return
    engine.stats.refresh(engine)
    try:
        conn.send(("ready", EngineInfo(engine.max_model_len, engine.model_config, engine.weights_summary,
                                       engine.tokenizer, _snapshot(engine.stats), engine.generation_defaults,
                                       engine.scheduling_policy, engine.eos_token_ids,
                                       engine.classifier_labels, engine.pooling_only, engine.config)))
        _serve(conn, engine, max_waiting)
    except (EOFError, OSError):   # the server's process is gone
        return
    except BaseException as e:  # noqa: BLE001 (every waiter gets it)
        log.exception("the engine process failed")
        _send_if_open(conn, ("died", _sendable(e)))
        return
    _send_if_open(conn, ("stopped",))


def _exit_with_parent(parent: int) -> None:
    """End this process once the server's process is gone, also while the engine builds (nothing reads the
    pipe then, whose closing would tell)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _send_if_open(conn, message) -> None:
    try:
        conn.send(message)
    except OSError:   # the server's process is gone
        pass


def _serve(conn, engine, max_waiting: int) -> None:
    stopping = None
    while True:
        out, embeds = [], []
        # block for the next command only when there is nothing to step
        commands = had_commands = conn.poll(None if not engine.has_unfinished() and stopping is None else 0)
        while commands:
            cmd = conn.recv()
            if cmd[0] == "stop":
                stopping = "drain" if cmd[1] else "now"
            elif cmd[0] == "add" and len(engine.scheduler.waiting) >= max_waiting:
                out.append((cmd[1], QueueFullError(f"{max_waiting} requests are already waiting")))
            elif cmd[0] == "embed":
                embeds.append(cmd)     # run together once the pipe is read
            else:
                out += apply_command(engine, cmd)
            commands = conn.poll(0)
        if embeds:    # each answer is sent as it lands
            apply_commands(engine, embeds, lambda items: conn.send(("out", items, _snapshot(engine.stats))))
        if had_commands:
            engine.stats.refresh(engine)   # gauges stay true after aborts with no step (a step refreshes them itself)
        if stopping == "drain" and engine.is_paused:
            engine.resume_generation()    # the requests a pause kept or held finish too
        if stopping == "now" or (stopping == "drain" and not engine.has_unfinished()):
            return
        out += [(d.request_id, d) for d in engine.step()] + engine.pause_state.answers()
        conn.send(("out", out, _snapshot(engine.stats)))


def _snapshot(stats: EngineStats) -> EngineStats:
    """The stats without their per-step time window (the server's process does not read it)."""
    return dataclasses.replace(stats, step_seconds=None)


def _sendable(error: BaseException) -> BaseException:
    """`error` if it survives pickling (atlasjax's errors do), else a RuntimeError that names it."""
    import pickle  # noqa: PLC0415
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")

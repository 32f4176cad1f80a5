"""Multi-host: one program on every host, `jax.distributed` underneath, process 0 in charge.

Launch the same command on every host with the same coordinator (process 0's host:port), the
number of processes and each process's id, from flags or the environment:

    ATLASJAX_COORDINATOR_ADDRESS=host0:8476 ATLASJAX_NUM_PROCESSES=2 ATLASJAX_PROCESS_ID=$I \
        python -m atlasjax serve --model DIR --tensor-parallel-size 16   # 2 hosts x 8 GPUs

Every process builds the same engine and loads only the shards of its own devices. Process 0
schedules, serves HTTP and runs the engine loop; before each device step it publishes the step
(which runner method, its host arrays) through the coordinator's key-value store, and the other
processes (`follow`) replay it, so all of them enter the same SPMD computation with the same inputs.
Outputs are replicated, so only process 0 reads them back. Device arrays passed between steps (the
previous step's sampled tokens, under async scheduling) travel as references to the step that
made them: each process holds its own copy.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import time

import jax
import numpy as np

from atlasjax.errors import EngineConfigError

_PREFIX = "atlasjax/step/"
_STOP = "stop"
_KEEP = 8   # a follower keeps the outputs of this many recent steps (references point back 1-2 steps)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str
    num_processes: int
    process_id: int

    @classmethod
    def from_env(cls, coordinator_address=None, num_processes=None, process_id=None) -> DistributedConfig | None:
        """Flags win over ATLASJAX_COORDINATOR_ADDRESS / ATLASJAX_NUM_PROCESSES / ATLASJAX_PROCESS_ID; None
        when neither names a coordinator (single process)."""
        address = coordinator_address or os.environ.get("ATLASJAX_COORDINATOR_ADDRESS")
        if not address:
            return None
        try:
            n = int(num_processes if num_processes is not None else os.environ["ATLASJAX_NUM_PROCESSES"])
            pid = int(process_id if process_id is not None else os.environ["ATLASJAX_PROCESS_ID"])
        except (KeyError, ValueError) as e:
            raise EngineConfigError("multi-host needs the number of processes and this process's id "
                                    "(--num-processes/--process-id or ATLASJAX_NUM_PROCESSES/ATLASJAX_PROCESS_ID)") from e
        if not 0 <= pid < n:
            raise EngineConfigError(f"process id {pid} is not in [0, {n})")
        return cls(address, n, pid)


def initialize(config: DistributedConfig | None) -> None:
    """jax.distributed.initialize (before any other jax call); on CPU, cross-process collectives via gloo."""
    if config is None or config.num_processes == 1:
        return
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(config.coordinator_address, num_processes=config.num_processes,
                               process_id=config.process_id)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def broadcast_int(value: int) -> int:
    """Process 0's value on every process (e.g. the KV pool size, which must agree)."""
    if not is_multiprocess():
        return value
    from jax.experimental import multihost_utils  # noqa: PLC0415
    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


class StepChannel:
    """Process 0 publishes numbered messages; every other process reads them in order."""

    def __init__(self, timeout_ms: int = 24 * 3600 * 1000):
        from jax._src import distributed  # noqa: PLC0415  (the coordinator's key-value store)
        self.client = distributed.global_state.client
        if self.client is None:
            raise EngineConfigError("jax.distributed is not initialized")
        self.timeout_ms = timeout_ms
        self.counter = itertools.count()

    def publish(self, message) -> int:
        n = next(self.counter)
        self.client.key_value_set_bytes(f"{_PREFIX}{n}", pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        if n >= _KEEP * 4:   # followers are at most a step behind: old messages can go
            try:
                self.client.key_value_delete(f"{_PREFIX}{n - _KEEP * 4}")
            except Exception:  # noqa: BLE001  (best effort)
                pass
        return n

    def receive(self):
        n = next(self.counter)
        return n, pickle.loads(self.client.blocking_key_value_get_bytes(f"{_PREFIX}{n}", self.timeout_ms))


class _Ref:
    """A device array produced by an earlier published step (field path into its output)."""
    def __init__(self, step: int, field: str):
        self.step, self.field = step, field


class BroadcastingRunner:
    """On process 0: publishes every device-step call of a ModelRunner, then makes it."""
    STEPS = ("decode", "prefill", "verify", "admit", "warmup", "checkpoint_params")   # calls every process must make

    def __init__(self, runner, channel: StepChannel):
        self._runner = runner
        self._channel = channel
        self._made: dict[int, tuple[int, str]] = {}   # id(device array) -> (step, field)
        self.published = 0            # steps published, and the host time spent publishing them
        self.publish_seconds = 0.0

    def __getattr__(self, name):
        attr = getattr(self._runner, name)
        if name not in self.STEPS:
            return attr

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            step = self._channel.publish((name, self._encode(args), self._encode(kwargs)))
            self.published += 1
            self.publish_seconds += time.perf_counter() - t0
            out = attr(*args, **kwargs)
            if out is not None and hasattr(out, "tokens"):
                self._made = {k: v for k, v in self._made.items() if v[0] > step - _KEEP}
                for field in ("tokens", "last_tokens", "emitted"):   # what later steps gather (gather_tokens, emitted)
                    if getattr(out, field, None) is not None:
                        self._made[id(getattr(out, field))] = (step, field)
            return out
        return call

    def stop_followers(self) -> None:
        self._channel.publish((_STOP, (), {}))

    def _encode(self, tree):
        def enc(x):
            if isinstance(x, jax.Array):
                if id(x) not in self._made:
                    raise RuntimeError("a device array that no published step made cannot be sent to followers")
                return _Ref(*self._made[id(x)])
            return x
        return jax.tree.map(enc, tree, is_leaf=lambda x: isinstance(x, jax.Array))


def follow(runner, channel: StepChannel) -> None:
    """On processes other than 0: replay process 0's steps until it stops."""
    outputs: dict[int, object] = {}
    while True:
        step, (name, args, kwargs) = channel.receive()
        if name == _STOP:
            return

        def dec(x):
            return getattr(outputs[x.step], x.field) if isinstance(x, _Ref) else x
        args, kwargs = jax.tree.map(dec, (args, kwargs), is_leaf=lambda x: isinstance(x, _Ref))
        out = getattr(runner, name)(*args, **kwargs)
        if hasattr(out, "tokens"):   # step outputs that later steps may refer to (not a gathered checkpoint)
            outputs[step] = out
            outputs.pop(step - _KEEP, None)

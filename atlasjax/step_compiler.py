"""Compiling step programs ahead of time: each step (a `StepSpec`) is lowered and compiled once per key, or
loaded whole from the program store (atlasjax/program_store.py) when it is on, and every compile is logged as one
JSON line on the `atlasjax.compile` logger. Under tensor parallelism the host inputs are replicated over the mesh as
they are passed (`_on_mesh`).

`StepCompiler` is the base of `ModelRunner` (atlasjax/runner.py), which sets `plan`, `params` and `state`.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import threading
import time
from typing import Any, Callable, NamedTuple

import jax

from atlasjax import program_store
from atlasjax.step_options import step_compiler_options
from pallas_kernels import lowering_memo

log = logging.getLogger("atlasjax.compile")


def _shape_of(key: tuple) -> list:
    """A step key's shape part, as a compile log line prints it."""
    return [k if isinstance(k, (int, bool)) else str(k) for k in key[1:]]


class StepSpec(NamedTuple):
    """One step program: its compile key, the function, the donated argument positions and the arguments."""
    key: tuple
    fn: Callable
    donate: tuple[int, ...]
    args: tuple[Any, ...]


class StepCompiler:
    """Compiles (or loads) and runs step programs; counts them. Subclasses set `plan` (a TensorParallel or None),
    `params` and `state` (both passed to every step as they are, already on the mesh)."""
    plan = None

    def _init_compiler(self) -> None:
        self.num_compiles = 0
        self.num_loaded = 0   # step programs loaded from the program store instead of compiled
        self.compile_seconds = 0.0
        self._compiled: dict = {}
        self._store_keys: dict = {}   # step key -> its program store key
        self._compile_lock = threading.Lock()   # warmup compiles in threads

    def _run(self, spec: StepSpec):
        return self._compile(spec)(*spec.args)

    def _compile(self, spec: StepSpec):
        """The compiled step of `spec`: loaded from the program store, else lowered and compiled; once per key."""
        if spec.key in self._compiled:
            return self._compiled[spec.key]
        loaded = self._load_stored(spec)
        return loaded if loaded is not None else self._compile_lowered(spec, *self._lower(spec))

    def _lower(self, spec: StepSpec):
        """(jax's Lowered of spec, the seconds lowering took)."""
        t0 = time.perf_counter()
        lowered = jax.jit(spec.fn, donate_argnums=spec.donate).lower(*self._on_mesh(spec.args))
        return lowered, time.perf_counter() - t0

    def _compile_lowered(self, spec: StepSpec, lowered, lower_seconds: float):
        t0 = time.perf_counter()
        compiled = lowered.compile(compiler_options=self._compiler_options)
        dt = time.perf_counter() - t0
        store_key = self._store_key(spec)
        stored = store_key is not None and self._program_store.save(store_key, compiled)
        with self._compile_lock:
            self.num_compiles += 1
            self.compile_seconds += lower_seconds + dt
            # One structured (JSON) line per compile, so logs can be counted and grepped.
            log.info("compile %s", json.dumps({"step": spec.key[0], "shape": _shape_of(spec.key),
                                               "seconds": round(lower_seconds + dt, 3),
                                               "lower_seconds": round(lower_seconds, 3),
                                               "num_compiles": self.num_compiles, "stored": stored}))
            return self._register(spec.key, compiled)

    def _load_stored(self, spec: StepSpec):
        """The compiled step of `spec` from the program store (atlasjax/program_store.py), or None."""
        store_key = self._store_key(spec)
        if store_key is None:
            return None
        t0 = time.perf_counter()
        compiled = self._program_store.load(store_key, self._execution_devices)
        if compiled is None:
            return None
        with self._compile_lock:
            self.num_loaded += 1
            log.info("load %s", json.dumps({"step": spec.key[0], "shape": _shape_of(spec.key),
                                            "seconds": round(time.perf_counter() - t0, 3)}))
            return self._register(spec.key, compiled)

    def _is_stored(self, spec: StepSpec) -> bool:
        store_key = self._store_key(spec)
        return store_key is not None and self._program_store.has(store_key)

    def _register(self, key, compiled):
        if self.plan is not None:
            compiled = functools.partial(self._call_on_mesh, compiled)
        return self._compiled.setdefault(key, compiled)

    @functools.cached_property
    def _program_store(self):   # asked first in the calling thread (warmup), before any compile thread
        return program_store.from_jax_config()

    def _store_key(self, spec: StepSpec) -> str | None:
        """spec's key in the program store, made once per step (it flattens the params); None without a
        store (or a key)."""
        if self._program_store is None:
            return None
        if spec.key not in self._store_keys:
            # host inputs keyed as they are (under TP `_on_mesh` replicates them, the same way every time)
            self._store_keys[spec.key] = self._program_store.key(spec.key, spec.fn, spec.donate, spec.args,
                                                                 self._compiler_options)
        return self._store_keys[spec.key]

    @functools.cached_property
    def _execution_devices(self) -> list:
        """The devices a step program runs on, in the order it was compiled for."""
        if self.plan is not None:
            return list(self.plan.mesh.devices.flat)
        leaf = jax.tree.leaves(self.params)[0]
        return sorted(leaf.sharding.device_set, key=lambda d: d.id)

    def _on_mesh(self, tree):
        """Tensor parallel: host inputs (and arrays on one device) become replicated over the mesh;
        params and device state keep their shardings. Identity on one device."""
        if self.plan is None:
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        host = [i for i, x in enumerate(leaves) if not isinstance(x, jax.ShapeDtypeStruct)
                and not (isinstance(x, jax.Array) and x.sharding.device_set == self._mesh_devices)]
        for i, x in zip(host, jax.device_put([leaves[i] for i in host], self.plan.replicated)):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    @functools.cached_property
    def _compiler_options(self) -> dict:
        if self.plan is None:
            return step_compiler_options(jax.devices()[0].platform, 1)
        mesh = self.plan.mesh.devices
        return step_compiler_options(mesh.flat[0].platform, mesh.size)

    @functools.cached_property
    def _mesh_devices(self):
        return set(self.plan.mesh.devices.flat)

    def _call_on_mesh(self, compiled, *args):
        # params and device state are on the mesh already (and large): only the host inputs move
        return compiled(*(a if a is self.params or a is self.state else self._on_mesh(a) for a in args))

    def compile_specs(self, specs: list[StepSpec], threads: int) -> None:
        """Compile (or load from the program store) every spec not compiled yet, the compiles in `threads` threads;
        log what it took."""
        specs = [spec for spec in specs if spec.key not in self._compiled]
        t0 = time.perf_counter()
        _ = self._program_store, self._execution_devices   # made here, not raced for in the threads
        stored = [spec for spec in specs if self._is_stored(spec)]
        stored_keys = {spec.key for spec in stored}
        # What the store lacks compiles first: an XLA CPU executable compiled after this process loaded
        # others can come back incomplete from the store (program_store.ProgramStore.save).
        jobs = self._compile_all([spec for spec in specs if spec.key not in stored_keys], threads)
        # Stored programs load in threads (0.5-1.2 s each at 8B shapes on an H100, mostly outside the GIL).
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="atlasjax-compile") as pool:
            loaded = [spec for spec, found in zip(stored, pool.map(self._load_stored, stored)) if found is not None]
        jobs += self._compile_all([spec for spec in stored if spec.key not in self._compiled], threads)   # unreadable
        log.info("warmup %s", json.dumps({"programs": len(jobs) + len(loaded), "loaded": len(loaded),
                                          "seconds": round(time.perf_counter() - t0, 2),
                                          "lower_seconds": round(sum(lowered[1] for _, lowered in jobs), 2),
                                          "kernel_lowering_memo": lowering_memo.stats()}))

    def _compile_all(self, specs: list[StepSpec], threads: int) -> list:
        """Lower each of `specs` here, one at a time, and compile them in `threads` threads (outside the
        GIL): programs lowered in concurrent threads came out different from one start to the next on a
        GPU (session 43), so a restart missed every entry of the compilation cache. Returns each spec with
        its (Lowered, lowering seconds)."""
        jobs = []
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="atlasjax-compile") as pool:
            for spec in specs:
                lowered = self._lower(spec)
                jobs.append((spec, lowered, pool.submit(self._compile_lowered, spec, *lowered)))
        retry = []
        for spec, lowered, done in jobs:
            error = done.exception()
            if error is None:
                continue
            if threads == 1 or "RESOURCE_EXHAUSTED" not in str(error):
                raise error
            retry.append((spec, lowered))   # concurrent autotuners ran out of device memory: again, one at a time
        if retry:
            log.warning("warmup: %d of %d compiles ran out of device memory in %d threads; compiling them one "
                        "at a time", len(retry), len(jobs), threads)
        for spec, lowered in retry:
            self._compile_lowered(spec, *lowered)
        return [(spec, lowered) for spec, lowered, _ in jobs]


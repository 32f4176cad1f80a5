"""Compiled step programs kept on disk, keyed without tracing: a restart loads them instead of lowering.

jax's persistent compilation cache keys an executable on its lowered program, so even a restart that
finds every executable there first traces and lowers every step program. At 8B shapes that lowering was
42 of the 56.5 s an int4 server took to restart on an H100 (session 44). This store keys each compiled
step on what the program is made from instead, all of it known before tracing:
- the step (its name, shapes and sampling plan), the step function with its static arguments (the model
  and its config, the packed-input layout), the donated arguments and the compile options;
- every argument's tree structure, shape, dtype and sharding;
- the source of atlasjax, models and pallas_kernels; the jax, jaxlib and plugin versions; jax's
  configuration; the devices; $XLA_FLAGS and every $ATLASJAX_* switch.
Any change in these is a different key, and the program is lowered and compiled as before.

It lives in the `programs` folder of jax's compilation cache directory (a local one, not gs://...), so on
a GPU it is on whenever that cache is (`python -m atlasjax` on a GPU by default, `--compilation-cache
DIR`, `compile_cache.enable`), and is capped as that cache is, least recently used first.
$ATLASJAX_PROGRAM_STORE=off switches it off. Not used by multi-host runs (each process would need the
others' programs). An entry is an executable serialized by
jax (`jax.experimental.serialize_executable`): loading one runs code from the cache directory, as jax's own
cache does, so keep that directory as private as the code. An entry that cannot be read is removed and its
program compiled again.

It is used on GPUs. XLA CPU executables do not load together when two processes wrote them: XLA names
the functions of a CPU executable per process, and loading programs of two writers into one process
failed at their first run ("Function negate_power_fusion not found"). So on a CPU the store is off
unless $ATLASJAX_PROGRAM_STORE=on (the tests, which restart from one writer), and a CPU process that
has loaded a program writes none. The warm-up compiles what the store lacks before it loads the rest.
GPU executables carry their own kernel modules: session 45 loaded programs of two writers together on
an H100 and answered bit for bit.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger("atlasjax.compile")

ENV = "ATLASJAX_PROGRAM_STORE"
FORMAT = 1
SUFFIX = ".program"
PACKAGES = ("atlasjax", "models", "pallas_kernels")
# jax options that do not change a program (where caches and logs go)
_UNKEYED_OPTIONS = ("cache", "log", "explain")


def enabled(platform: str) -> bool:
    """$ATLASJAX_PROGRAM_STORE: unset or auto, on a GPU only; on, on every platform (a CPU only where one
    process wrote every entry, see above: the tests); off, 0 or false, never."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("off", "0", "false"):
        return False
    return value in ("on", "1", "true") or platform != "cpu"


def from_jax_config() -> ProgramStore | None:
    """The store inside jax's compilation cache directory when that cache is on (`store_in`)."""
    directory = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    return store_in(directory, jax.config.jax_compilation_cache_max_size)


def store_in(cache_dir: str | None, max_bytes: int = -1) -> ProgramStore | None:
    """The store in `cache_dir`/programs; None without a local directory (jax's cache may also live in a
    bucket, gs://...), switched off, or multi-host."""
    platform = jax.default_backend()
    if not (cache_dir and enabled(platform)) or "://" in str(cache_dir) or jax.process_count() > 1:
        return None
    return ProgramStore(Path(cache_dir) / "programs", max_bytes=max_bytes, platform=platform)


class ProgramStore:
    """Compiled programs in `directory`, one file per key; at most `max_bytes` (<= 0: no cap)."""

    def __init__(self, directory, max_bytes: int = -1, platform: str = "gpu"):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        # XLA CPU: a program compiled after the process loaded others can refer to code of those (it came
        # back from the store missing functions, "Function ... not found"), so it is not written.
        self.writes_after_loads = platform != "cpu"
        self.num_loaded = 0

    def has(self, key: str) -> bool:
        return (self.directory / (key + SUFFIX)).is_file()

    def key(self, step: tuple, fn, donate: tuple, args: tuple, compiler_options: dict) -> str | None:
        """The key of the program `jax.jit(fn, donate_argnums=donate)` compiles for `args`; None when part
        of it would differ from one process to the next (an object printed with its address)."""
        leaves, treedef = jax.tree.flatten(args)
        parts = repr((FORMAT, environment_digest(), repr(step), describe(fn), donate, str(treedef),
                      [aval_of(x) for x in leaves], sorted(compiler_options.items())))
        if " at 0x" in parts:
            log.info("program store: not keying %s, its description names an address", step)
            return None
        return hashlib.sha256(parts.encode()).hexdigest()

    def load(self, key: str, devices) -> jax.stages.Compiled | None:
        """The stored program of `key` loaded onto `devices` (its execution devices, in order); None when
        there is none or it cannot be read (then it is removed)."""
        path = self.directory / (key + SUFFIX)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("program store: cannot read %s: %s", path, e)
            return None
        from jax.experimental import serialize_executable  # noqa: PLC0415
        try:
            entry = pickle.loads(blob)
            if entry["format"] != FORMAT:
                raise ValueError(f"format {entry['format']}")
            compiled = serialize_executable.deserialize_and_load(
                entry["executable"], entry["in_tree"], entry["out_tree"], backend=devices[0].client,
                execution_devices=list(devices))
        except Exception as e:  # noqa: BLE001  (a bad entry must never stop a start: compile instead)
            log.warning("program store: dropping unreadable %s (%s: %s)", path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)   # recently used: evicted last
        self.num_loaded += 1
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Write `compiled` under `key` (atomically; a program jax cannot serialize is skipped). True when
        written."""
        if self.num_loaded and not self.writes_after_loads:
            log.info("program store: not storing a CPU program compiled after this process loaded others")
            return False
        from jax.experimental import serialize_executable  # noqa: PLC0415
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            blob = pickle.dumps({"format": FORMAT, "executable": executable, "in_tree": in_tree,
                                 "out_tree": out_tree})
        except Exception as e:  # noqa: BLE001
            log.info("program store: not storing a program jax cannot serialize (%s: %s)", type(e).__name__, e)
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".tmp", delete=False) as f:
                f.write(blob)
            os.replace(f.name, self.directory / (key + SUFFIX))
        except OSError as e:
            log.warning("program store: cannot write to %s: %s", self.directory, e)
            return False
        self._evict()
        return True

    def _evict(self) -> None:
        """Remove the least recently used entries past max_bytes, and partial writes over an hour old (a
        process that stopped while writing)."""
        for path in self.directory.glob("*.tmp"):
            try:
                if time.time() - path.stat().st_mtime > 3600:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                continue
        if self.max_bytes is None or self.max_bytes <= 0:
            return
        entries = []
        for path in self.directory.glob("*" + SUFFIX):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


def describe(fn) -> str:
    """A step function with its static arguments, without the addresses that `repr` prints."""
    if isinstance(fn, functools.partial):
        return f"{describe(fn.func)}({', '.join(map(repr, fn.args))}; {sorted(fn.keywords.items())!r})"
    return f"{fn.__module__}.{fn.__qualname__}"


def aval_of(x) -> tuple:
    """An argument leaf as the program sees it: shape, dtype, weak type and sharding."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return (x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)), repr(x.sharding))
    x = np.asarray(x)
    return (x.shape, str(x.dtype))


@functools.cache
def environment_digest() -> str:
    """What every program of this process is made with, besides its own arguments."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    versions = {name: getattr(sys.modules.get(name), "__version__", None)
                for name in ("jax", "jaxlib", "flax", "numpy")}
    for plugin in ("jax_cuda13_plugin", "jax_cuda12_plugin"):
        try:
            from importlib.metadata import version  # noqa: PLC0415
            versions[plugin] = version(plugin.replace("_", "-"))
        except Exception:  # noqa: BLE001  (not installed)
            pass
    options = sorted((k, repr(v)) for k, v in jax.config.values.items()
                     if not any(word in k for word in _UNKEYED_OPTIONS))
    switches = sorted((k, v) for k, v in os.environ.items()
                      if (k.startswith("ATLASJAX_") and k not in (ENV, "ATLASJAX_COMPILATION_CACHE",
                                                                    "ATLASJAX_COMPILE_THREADS"))
                      or k in ("XLA_FLAGS", "JAX_PLATFORMS"))
    devices = [(d.platform, d.device_kind, d.client.platform_version) for d in jax.devices()]
    h.update(repr((versions, options, switches, devices)).encode())
    return h.hexdigest()

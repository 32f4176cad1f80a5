"""KV cache offloading's third tier: prefix-cache pages in files on a local disk (`kv_offloading_disk`), under
the host-memory tier (atlasjax/kv_offload.py), as the local-disk tiers of LMCache, SGLang's HiCache and ARLE.

Every page the host tier saves is also written here (write-through, by a background thread), so the disk
holds what host memory drops, and what a later engine on the same weights may read: the files outlive the
process. A page is one file, `<directory>/<fingerprint>/<digest of its prefix-cache key>.kv`, the raw bytes of
its per-pool arrays. The fingerprint names what the bytes depend on (`fingerprint()`: the weight files, dtypes,
page layout, tensor parallelism, atlasjax's version); engines of other weights or settings never see each
other's pages. Weights that cannot be named that way (given in memory, or changed by `update_params`) get a
namespace of their own that is removed at exit.

Reads happen when a waiting prompt's prefix reaches a page held only here (`HostKVCache.fetching`): a background
thread reads the rest of its run while other requests are scheduled, and the prompt is admitted with those pages
once they are in memory. A file that is missing, truncated or unreadable is a miss: the prompt computes that page
again. Files are dropped least recently used first beyond `capacity_bytes`. Engines of the same namespace running
at once (data-parallel replicas) read each other's files; each counts toward its size only the files it wrote or
read.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import hashlib
import json
import logging
import math
import os
import queue
import shutil
import threading
import time
import uuid

import numpy as np

log = logging.getLogger("atlasjax.engine")

SUFFIX = ".kv"
READERS = 8     # files read at once on a lookup


def key_digest(key: tuple) -> str:
    """A file name for a prefix-cache key (parent hash, token ids): stable across processes for the base model's
    pages (ints and tuples hash alike in every CPython process; LoRA adapters' and salted roots do not, so their
    pages are found only by the process that wrote them)."""
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()


def fingerprint(config, page_layouts, weights_named: bool) -> str | None:
    """What a page's bytes depend on, as a digest; None when the weights cannot be named by their files."""
    import jax  # noqa: PLC0415

    import atlasjax  # noqa: PLC0415
    from atlasjax.default_model import ensure_default_model  # noqa: PLC0415
    if not weights_named:
        return None
    fields = {"version": atlasjax.__version__, "layouts": [[list(s), str(d)] for s, d in page_layouts],
              "devices": sorted({d.device_kind for d in jax.devices()})}
    for name in ("dtype", "kv_cache_dtype", "calculate_kv_scales", "quantization", "quantization_group_size",
                 "quantization_symmetric", "quantize_lm_head", "activation_quantization", "keep_gguf_quantized",
                 "hf_overrides", "tensor_parallel_size", "page_size", "load_format", "seed", "attention_backend"):
        fields[name] = repr(getattr(config, name, None))
    fields["model"] = _files(config.model or ensure_default_model(progress=False))
    spec = config.speculative_config
    if spec is not None and getattr(spec, "uses_draft_model", False):
        fields["draft"] = _files(spec.model)
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=12).hexdigest()


def _files(path: str) -> list:
    """The path, and each file under it with its size and modification time (symlinks followed)."""
    path = os.path.realpath(path)
    if os.path.isfile(path):
        st = os.stat(path)
        return [path, st.st_size, st.st_mtime_ns]
    out = [path]
    for root, dirs, names in os.walk(path, followlinks=True):
        dirs.sort()
        for name in sorted(names):
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            out.append([os.path.relpath(os.path.join(root, name), path), st.st_size, st.st_mtime_ns])
    return out


def layout_bytes(page_layouts) -> int:
    """One page's bytes across its KV pools (page_layouts: per pool, a shape and a dtype)."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in page_layouts)


def check_directory(path: str | None) -> None:
    """Refuse a kv_offloading_disk that cannot be a writable directory (before the model loads)."""
    from atlasjax.errors import EngineConfigError  # noqa: PLC0415
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise OSError("not writable")
    except OSError as e:
        raise EngineConfigError(f"kv_offloading_disk {path!r} cannot hold the pages: {e}") from None


class DiskKVStore:
    def __init__(self, directory: str, capacity_bytes: int, page_layouts, fingerprint_: str | None):
        """page_layouts: per KV pool, one page's shape and dtype (kv_offload.page_layouts); fingerprint_: the
        namespace (None: a fresh one, removed at exit)."""
        self.layouts = [(tuple(shape), np.dtype(dtype)) for shape, dtype in page_layouts]
        self.page_bytes = layout_bytes(self.layouts)
        self.capacity_pages = int(capacity_bytes // self.page_bytes)
        if self.capacity_pages < 1:
            raise ValueError(f"kv_offloading_disk_size holds no page: {capacity_bytes} bytes for pages of "
                             f"{self.page_bytes} bytes")
        self.persistent = fingerprint_ is not None
        self.path = os.path.join(directory, fingerprint_ or f"ephemeral-{uuid.uuid4().hex[:12]}")
        os.makedirs(self.path, exist_ok=True)
        self._lock = threading.Lock()
        self.index: collections.OrderedDict[str, None] = collections.OrderedDict()   # least recently used first
        self._pending: dict[str, tuple] = {}      # digest -> arrays not yet written
        self._queue: queue.Queue = queue.Queue()
        self.num_found = self._scan()
        self.num_written = self.num_read = 0
        self._readers = concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix="atlasjax-kv-disk-read")
        self._writer = threading.Thread(target=self._write_loop, name="atlasjax-kv-disk", daemon=True)
        self._writer.start()
        atexit.register(self.close)

    # ---- what the host tier asks
    def __contains__(self, key: tuple) -> bool:
        """Whether a page's file is known here, or was written by another engine of this namespace."""
        digest = key_digest(key)
        with self._lock:
            if digest in self.index:
                return True
        return os.path.exists(self._file(digest))

    @property
    def num_pages(self) -> int:
        return len(self.index)

    def put(self, key: tuple, arrays: tuple) -> None:
        """Write a page (per pool, arrays in host memory) later, on the writer thread."""
        digest = key_digest(key)
        with self._lock:
            if digest in self.index:
                self.index.move_to_end(digest)
                if digest not in self._pending:
                    self._touch(self._file(digest))
                return
            self.index[digest] = None
            self._pending[digest] = arrays
            dropped = self._over_capacity()
        self._remove(dropped)
        self._queue.put(digest)

    def get(self, key: tuple) -> tuple | None:
        """A page's arrays per pool (numpy, or the host arrays of a write still queued); None when it is not
        here or its file cannot be read (then it is forgotten). A file another engine wrote to the same
        namespace since this one started is found too."""
        run = self.get_run([key])
        return run[0] if run else None

    def get_run(self, keys: list[tuple]) -> list[tuple]:
        """`get` of the leading keys held here, up to the first that is not or cannot be read (files read in
        parallel)."""
        found = []
        for key in keys:
            digest = key_digest(key)
            with self._lock:
                known = digest in self.index
                if known:
                    self.index.move_to_end(digest)
                pending = self._pending.get(digest)
            if pending is None and not known and not os.path.exists(self._file(digest)):
                break
            found.append((digest, known, pending))
        out = []
        for arrays in self._readers.map(lambda item: self._load(*item), found):
            if arrays is None:
                break
            out.append(arrays)
        return out

    def _load(self, digest: str, known: bool, pending: tuple | None) -> tuple | None:
        if pending is not None:
            return pending
        try:
            data = np.fromfile(self._file(digest), np.uint8)
            if data.size != self.page_bytes:
                raise OSError(f"{data.size} bytes, a page has {self.page_bytes}")
        except OSError as e:
            log.warning("KV offloading: disk page %s unreadable (%s); computing it again", digest, e)
            with self._lock:
                self.index.pop(digest, None)
            self._remove([digest])
            return None
        if not known:
            with self._lock:
                self.index[digest] = None
                dropped = self._over_capacity()
            self._remove(dropped)
        with self._lock:
            self.num_read += 1
        self._touch(self._file(digest))
        out, start = [], 0
        for shape, dtype in self.layouts:
            size = math.prod(shape) * dtype.itemsize
            out.append(data[start:start + size].view(dtype).reshape(shape))
            start += size
        return tuple(out)

    def clear(self) -> None:
        """Forget and delete every page (the prefix cache was reset: the weights may have changed)."""
        self.flush(timeout=60)
        with self._lock:
            dropped = list(self.index)
            self.index.clear()
        self._remove(dropped)

    def forget_weights(self) -> None:
        """The weights changed in place: what is written from now on lands in a namespace of its own."""
        self.clear()
        if self.persistent:
            self.path = os.path.join(os.path.dirname(self.path), f"ephemeral-{uuid.uuid4().hex[:12]}")
            os.makedirs(self.path, exist_ok=True)
            self.persistent = False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued writes (True when none is left)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Finish the queued writes; an ephemeral namespace is removed."""
        if self._writer.is_alive():
            self.flush(timeout=60)
        if not self.persistent:
            shutil.rmtree(self.path, ignore_errors=True)

    # ---- files
    def _file(self, digest: str) -> str:
        return os.path.join(self.path, digest + SUFFIX)

    def _scan(self) -> int:
        """Index the pages a previous engine left (oldest first); drop half-written and foreign-sized files."""
        found = []
        for entry in os.scandir(self.path):
            if not entry.name.endswith(SUFFIX) or entry.stat().st_size != self.page_bytes:
                self._unlink(entry.path)
                continue
            found.append((entry.stat().st_mtime_ns, entry.name[:-len(SUFFIX)]))
        for _, digest in sorted(found):
            self.index[digest] = None
        self._remove(self._over_capacity())
        return len(self.index)

    def _over_capacity(self) -> list[str]:
        dropped = []
        while len(self.index) > self.capacity_pages:
            digest, _ = self.index.popitem(last=False)
            self._pending.pop(digest, None)
            dropped.append(digest)
        return dropped

    def _remove(self, digests) -> None:
        for digest in digests:
            self._unlink(self._file(digest))

    @staticmethod
    def _touch(path: str) -> None:
        """Mark a file used now, to the nanosecond (the order a later engine drops files in)."""
        try:
            now = time.time_ns()
            os.utime(path, ns=(now, now))
        except OSError:
            pass

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            with self._lock:
                arrays = self._pending.get(item)
                path = self.path
            if arrays is None:      # dropped (capacity, clear) before its turn
                continue
            target = os.path.join(path, item + SUFFIX)
            tmp = f"{target}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    for x in arrays:
                        f.write(np.ascontiguousarray(np.asarray(x)).view(np.uint8).data)
                os.replace(tmp, target)
                self._touch(target)
            except Exception as e:  # noqa: BLE001 (a full or failing disk: the page stays in host memory only)
                log.warning("KV offloading: writing disk page %s failed: %s", item, e)
                self._unlink(tmp)
                with self._lock:
                    self.index.pop(item, None)
                    self._pending.pop(item, None)
                continue
            with self._lock:
                self._pending.pop(item, None)
                kept = item in self.index and path == self.path
                if kept:
                    self.num_written += 1
            if not kept:           # dropped or cleared while it was written
                self._unlink(target)

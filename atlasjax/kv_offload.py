"""KV cache offloading: a second prefix-cache tier in host memory (vLLM's `kv_offloading_size`, SGLang's
hierarchical cache).

A cached page the device pool evicts (atlasjax/page_pool.py) is copied to host memory instead of lost;
a later prompt whose prefix runs past the device's hits into pages held here gets them copied back
into fresh device pages rather than computed again. Host entries are kept least recently used first
out, up to `capacity_bytes`, in one host buffer per KV pool taken at the first save (the OS commits its
memory as pages land).

The copies run on the device stream before the step that needs them: `sync()` is called by the engine
before it dispatches a step, with the pool's events of the scheduling just done. Pages evicted are
gathered first (before a refill or the step can overwrite them), then refilled pages scattered in.
Each page is stored as one array per KV pool (the model's, and a draft model's): every layer's K and V
for it, [2 * layers, kv heads, page_size, head_dim].
"""
from __future__ import annotations

import collections
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.errors import EngineConfigError

GiB = 1 << 30


class HostKVCache:
    def __init__(self, capacity_bytes: int, page_layouts: list[tuple[tuple[int, ...], np.dtype]]):
        """page_layouts: per KV pool, one page's shape ([2 * layers, kv heads, page_size, head_dim]) and dtype
        (`page_layouts(state)`)."""
        self.page_bytes = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in page_layouts)
        self.capacity_pages = int(capacity_bytes // self.page_bytes)
        if self.capacity_pages < 1:
            raise ValueError(f"kv_offloading_size holds no page: {capacity_bytes} bytes for pages of "
                             f"{self.page_bytes} bytes")
        # the OS commits these as pages land
        self.slabs = [np.empty((self.capacity_pages, *shape), dtype) for shape, dtype in page_layouts]
        self.entries: collections.OrderedDict[tuple, int] = collections.OrderedDict()   # key -> slot, oldest first
        self._free_slots = list(range(self.capacity_pages - 1, -1, -1))
        self._landing: list[tuple[list[tuple], tuple]] = []   # (keys, device arrays) still being copied to host
        self._landing_keys: set[tuple] = set()
        self._scatter = None
        self.num_saved_pages = 0
        self.num_restored_pages = 0

    def get(self, key: tuple) -> tuple[np.ndarray, ...]:
        """A page held here, per KV pool (for inspection)."""
        return tuple(slab[self.entries[key]] for slab in self.slabs)

    # ---- what the pool asks
    def __contains__(self, key: tuple) -> bool:
        return key in self.entries or key in self._landing_keys

    def clear(self) -> None:
        self._free_slots.extend(self.entries.values())
        self.entries.clear()
        self._landing.clear()
        self._landing_keys.clear()

    @property
    def num_pages(self) -> int:
        return len(self.entries)

    @property
    def used_bytes(self) -> int:
        return len(self.entries) * self.page_bytes

    # ---- the copies
    def sync(self, pool, runner) -> None:
        """Copy what `pool.events` logged: evicted pages to host, then refilled pages back to the device."""
        events, pool.events = pool.events, []
        saves, loads = [], {}
        for kind, page, key in events:
            if kind == "restore":
                loads[page] = key
            elif loads.pop(page, None) is None:   # a refill evicted before it landed has nothing new to save
                saves.append((page, key))
        self._land(keep=loads.values())
        for _, key in saves:
            if key in self.entries:
                self.entries.move_to_end(key)
        saves = [(page, key) for page, key in saves if key not in self.entries]
        if saves:
            gathered = _gather(_pools(runner.state), _padded(np.asarray([page for page, _ in saves], np.int32)))
            for x in gathered:
                x.copy_to_host_async()
            self._landing.append(([key for _, key in saves], gathered))
            self._landing_keys.update(key for _, key in saves)
        loads = {page: key for page, key in loads.items() if key in self.entries}   # (all but after a clear())
        if loads:
            slots = _padded(np.asarray([self.entries[key] for key in loads.values()]))
            data = tuple(slab[slots] for slab in self.slabs)
            if self._scatter is None:   # the pools keep their shardings (tensor parallel: split over KV heads)
                shardings = jax.tree.map(lambda x: x.sharding, _pools(runner.state))
                self._scatter = jax.jit(_scatter, donate_argnums=0, out_shardings=shardings)
            kv, draft_kv = self._scatter(_pools(runner.state), _padded(np.asarray(list(loads), np.int32)), data)
            runner.state = runner.state.replace(kv=kv, draft_kv=draft_kv)
            self.num_restored_pages += len(loads)

    def _land(self, keep) -> None:
        """Store the pages gathered by earlier syncs (their copies were queued before the steps since), then
        drop the least recently used past the capacity; never `keep` (the keys this sync refills: the pool
        was told they are here)."""
        keep = {key for key in keep if key in self.entries}
        for key in keep:
            self.entries.move_to_end(key)
        for keys, gathered in self._landing:
            rows, slots = [], []
            for i, key in enumerate(keys):
                if key in self.entries:
                    continue
                if not self._free_slots:
                    oldest = next(iter(self.entries), None)
                    if oldest is None or oldest in keep:
                        break                     # full of pages this sync refills: the rest are not kept
                    self._free_slots.append(self.entries.pop(oldest))
                rows.append(i)
                slots.append(self._free_slots.pop())
                self.entries[key] = slots[-1]
            for slab, x in zip(self.slabs, gathered):
                slab[slots] = np.asarray(x)[rows]
            self.num_saved_pages += len(slots)
        self._landing.clear()
        self._landing_keys.clear()


def check_host_memory(size_gib: float | None) -> None:
    """Refuse a kv_offloading_size larger than this host's memory (before the model loads)."""
    if size_gib is None:
        return
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size_gib * GiB > host:
        raise EngineConfigError(f"kv_offloading_size={size_gib:g} GiB exceeds this host's {host / GiB:.1f} GiB "
                                "of memory")


def page_layouts(state) -> list[tuple[tuple[int, ...], np.dtype]]:
    """Per KV pool (the model's, a draft model's): one page's shape across its layers, and its dtype."""
    out = []
    for pool in _pools(state):
        if pool:
            heads, _, page_size, head_dim = pool[0][0].shape
            out.append(((2 * len(pool), heads, page_size, head_dim), np.dtype(pool[0][0].dtype)))
    return out


def _pools(state) -> tuple:
    return state.kv, state.draft_kv


def _padded(x: np.ndarray) -> np.ndarray:
    """x with its first axis grown to a power of two by repeating x[0] (one compile per size class; a
    repeated page is gathered twice, or scattered twice with the same data)."""
    n = 1 << (len(x) - 1).bit_length()
    return x if n == len(x) else np.concatenate([x, np.repeat(x[:1], n - len(x), axis=0)])


@jax.jit
def _gather(pools, pages):
    """Per pool: [pages, 2 * layers, kv heads, page_size, head_dim]."""
    return tuple(jnp.stack([jnp.swapaxes(x[:, pages], 0, 1) for layer in pool for x in layer], axis=1)
                 for pool in pools if pool)


def _scatter(pools, pages, data):
    out, it = [], iter(data)
    for pool in pools:
        if not pool:
            out.append(pool)
            continue
        d = next(it)
        leaves = [x.at[:, pages].set(jnp.swapaxes(d[:, 2 * i + j], 0, 1).astype(x.dtype))
                  for i, layer in enumerate(pool) for j, x in enumerate(layer)]
        out.append(tuple(zip(leaves[0::2], leaves[1::2])))
    return tuple(out)

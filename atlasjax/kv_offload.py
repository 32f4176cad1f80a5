"""KV cache offloading: a second prefix-cache tier in host memory (vLLM's `kv_offloading_size`, SGLang's
hierarchical cache).

A cached page the device pool evicts (atlasjax/page_pool.py) is copied to host memory instead of lost;
a later prompt whose prefix runs past the device's hits into pages held here gets them copied back
into fresh device pages rather than computed again. Host entries are kept least recently used first
out, up to `capacity_bytes`.

Pages live as jax arrays in pinned host memory (memory kind "pinned_host"), so both copies are DMA
transfers that nothing on the host waits for. They are queued before the step that needs them: `sync()`
is called by the engine before it dispatches a step, with the pool's events of the scheduling just done.
Pages evicted are gathered first (before a refill or the step can overwrite them), then refilled pages
scattered in. A page is one array per KV pool (the model's, and a draft model's): every layer's K and V
for it, [2 * layers, kv heads, page_size, head_dim] (under tensor parallelism split over KV heads as the
pool is).

Pages held only on disk (atlasjax/kv_disk.py) are read in the background (`fetching`): their request waits
in the queue while others run, and is admitted once its pages are in memory.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax import distributed
from atlasjax.errors import EngineConfigError
from atlasjax.kv_disk import DiskKVStore, fingerprint, layout_bytes

log = logging.getLogger("atlasjax.engine")

GiB = 1 << 30
CHUNK = 64   # pages per copy program: one program per power of two up to it
RESERVE_BLOCK = 1 << 28
STAGED_SECONDS = 60.0   # pages read for a request that never claims them (aborted) are dropped after this
FETCH_SECONDS = 30.0    # a request waits at most this long for its files (a stalled disk): then it computes them


class HostKVCache:
    def __init__(self, capacity_bytes: int, page_layouts: list[tuple[tuple[int, ...], np.dtype]], disk=None):
        """page_layouts: per KV pool, one page's shape ([2 * layers, kv heads, page_size, head_dim]) and dtype
        (`page_layouts(state)`); disk: a DiskKVStore under this tier (atlasjax/kv_disk.py), or None."""
        self.page_bytes = layout_bytes(page_layouts)
        self.capacity_pages = int(capacity_bytes // self.page_bytes)
        if self.capacity_pages < 1:
            raise ValueError(f"kv_offloading_size holds no page: {capacity_bytes} bytes for pages of "
                             f"{self.page_bytes} bytes")
        # key -> the page per KV pool, in pinned host memory; least recently used first
        self.entries: collections.OrderedDict[tuple, tuple[jax.Array, ...]] = collections.OrderedDict()
        self._scatter = None
        self.disk = disk
        self._claimed: dict[tuple, tuple[jax.Array, ...]] = {}   # keys the pool refills at the next sync
        # disk reads in the background: key -> its run's future; pages read, waiting for their request's lookup
        self._reading: dict[tuple, concurrent.futures.Future] = {}
        self._staged: collections.OrderedDict[tuple, tuple[tuple, float]] = collections.OrderedDict()
        self._fetcher = None if disk is None else concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="atlasjax-kv-fetch")
        self.host_shardings = None   # per pool, where a page's host arrays live (set by the first gather)
        self.num_saved_pages = 0
        self.num_restored_pages = 0

    # ---- what the pool asks
    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def fetching(self, keys: list[tuple], limit: int) -> bool:
        """True while pages of this run of keys (past the device's hits; at most `limit`) are being read from
        files: its request should wait while others are scheduled. The first time a run reaches a page held only
        in a file, the reads of the rest of the run start in the background. False once nothing more is to be
        read: `claim` then finds the pages in memory."""
        if self._fetcher is None or self.host_shardings is None:
            return False
        self._collect()
        keys = keys[:limit]
        n = 0
        while n < len(keys) and self._in_memory(keys[n]):
            n += 1
        if n == len(keys):
            return False
        if keys[n] in self._reading:
            return time.monotonic() - self._reading[keys[n]].started < FETCH_SECONDS
        if keys[n] not in self.disk:
            return False
        run = [key for key in keys[n:] if not self._in_memory(key)]
        future = self._fetcher.submit(self._read_pinned, run)
        future.run_keys, future.started = run, time.monotonic()
        for key in run:
            self._reading[key] = future
        return True

    def _read_pinned(self, keys: list[tuple]) -> list[tuple]:
        """The leading pages of keys read from files (a fetch thread), copied to pinned host memory there: the
        copy to the device at the sync is then a DMA the engine thread does not wait for."""
        read = self.disk.get_run(keys)
        if not read:
            return read
        num_pools = len(read[0])
        pinned = jax.device_put([x for arrays in read for x in arrays],
                                [self.host_shardings[p] for _ in read for p in range(num_pools)])
        jax.block_until_ready(pinned)
        return [tuple(pinned[i * num_pools:(i + 1) * num_pools]) for i in range(len(read))]

    @property
    def num_reading(self) -> int:
        """Pages being read from files in the background now."""
        return sum(not future.done() for future in self._reading.values())

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a background read lands or `timeout` seconds pass (the engine has nothing else to run)."""
        if self._reading:
            concurrent.futures.wait(set(self._reading.values()), timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _in_memory(self, key: tuple) -> bool:
        return key in self.entries or key in self._staged

    def _collect(self) -> None:
        """Pages of finished reads wait for their request's lookup (unclaimed ones only STAGED_SECONDS)."""
        now = time.monotonic()
        for future in {f for f in self._reading.values() if f.done()}:
            for key in future.run_keys:
                self._reading.pop(key, None)
            try:
                read = future.result()
            except Exception as e:  # noqa: BLE001 (a failing disk: the pages are computed again)
                log.warning("KV offloading: reading disk pages failed: %s", e)
                continue
            for key, arrays in zip(future.run_keys, read):
                self._staged[key] = (arrays, now)
        while self._staged and next(iter(self._staged.values()))[1] < now - STAGED_SECONDS:
            self._staged.popitem(last=False)

    def claim(self, keys: list[tuple], limit: int) -> int:
        """How many of `keys`, from the first, this tier can refill (at most `limit`): those in host memory or
        read from files already (`fetching`, which the scheduler asks first). Each is held for the next `sync`
        (the copy to the device), whatever host memory drops meanwhile."""
        self._collect()
        n = 0
        for key in keys[:limit]:
            if key in self.entries:
                self.entries.move_to_end(key)
                self._claimed[key] = self.entries[key]
            elif key in self._staged:
                self._claimed[key] = self._staged.pop(key)[0]
            else:
                break
            n += 1
        return n

    def clear(self) -> None:
        self.entries.clear()
        self._staged.clear()
        self._reading.clear()      # reads in flight land nowhere
        if self.disk is not None:
            self.disk.clear()

    @property
    def num_pages(self) -> int:
        return len(self.entries)

    def get(self, key: tuple) -> tuple[np.ndarray, ...]:
        """A page held here, per KV pool (for inspection)."""
        return tuple(np.asarray(x) for x in self.entries[key])

    # ---- the copies
    def reserve(self, state) -> float:
        """Grow the pinned-host allocator of each device holding the pools to the capacity once, then give
        the memory back to it: saves reuse it. Allocating pinned memory fresh runs at about 1 GiB/s, reused
        at about 29 (H200, notebooks/gpu_pinned_host_alloc.py). Returns the seconds it took."""
        t0 = time.perf_counter()
        devices = sorted(jax.tree.leaves(_pools(state))[0].sharding.device_set, key=lambda d: d.id)
        share = self.capacity_pages * self.page_bytes // len(devices)
        block = min(share, RESERVE_BLOCK)
        zeros = np.zeros(block, np.uint8)
        held = [jax.device_put(zeros, jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host"))
                for d in devices for _ in range(-(-share // block))]
        jax.block_until_ready(held)
        del held
        return time.perf_counter() - t0

    def warmup(self, runner) -> None:
        """Compile the copy programs for every chunk size (each page 0 copied out and back: no change)."""
        n = 1
        while n <= CHUNK:
            page = self._gathered(runner.state, [0] * n)[0]
            self._restore(runner, [(0, page)] * n)
            n *= 2
        self.num_restored_pages = 0

    def sync(self, pool, runner) -> None:
        """Queue the copies `pool.events` logged: evicted pages to host, then refilled pages to the device."""
        events, pool.events = pool.events, []
        saves, loads = [], {}
        for kind, page, key in events:
            if kind == "restore":
                loads[page] = key
            elif loads.pop(page, None) is None:   # a refill evicted before it landed has nothing new to save
                saves.append((page, key))
        claimed, self._claimed = self._claimed, {}
        refills = [(page, arrays) for page, key in loads.items()                   # before saves push any out
                   if (arrays := claimed.get(key) or self.entries.get(key)) is not None]
        for key in loads.values():
            if key in self.entries:
                self.entries.move_to_end(key)
        for _, key in saves:
            if key in self.entries:
                self.entries.move_to_end(key)
        saves = [(page, key) for page, key in saves if key not in self.entries]
        for chunk in _chunks(saves):
            self._save(runner.state, chunk)
        for chunk in _chunks(refills):
            self._restore(runner, chunk)

    def _save(self, state, chunk: list[tuple[int, tuple]]) -> None:
        for (_, key), arrays in zip(chunk, self._gathered(state, [page for page, _ in chunk])):
            self.entries[key] = arrays
            if self.disk is not None:     # written through: the disk keeps what host memory drops
                self.disk.put(key, arrays)
        self.num_saved_pages += len(chunk)
        self._drop_oldest()

    def _drop_oldest(self) -> None:
        while len(self.entries) > self.capacity_pages:
            self.entries.popitem(last=False)

    def _gathered(self, state, pages: list[int]) -> list[tuple[jax.Array, ...]]:
        """Each page's arrays (per KV pool), copied to pinned host memory (queued, not waited for)."""
        per_pool = _gather(_pools(state), np.asarray(_padded(pages), np.int32))   # per pool: an array per page
        flat = [x for arrays in per_pool for x in arrays[:len(pages)]]
        host = jax.device_put(flat, [x.sharding.with_memory_kind("pinned_host") for x in flat])
        if self.host_shardings is None:
            self.host_shardings = tuple(host[p * len(pages)].sharding for p in range(len(per_pool)))
        return [tuple(host[p * len(pages) + i] for p in range(len(per_pool))) for i in range(len(pages))]

    def _restore(self, runner, chunk: list[tuple[int, tuple]]) -> None:
        pools = _pools(runner.state)
        if self._scatter is None:   # the pools keep their shardings (tensor parallel: split over KV heads)
            self._scatter = jax.jit(_scatter, donate_argnums=0,
                                    out_shardings=jax.tree.map(lambda x: x.sharding, pools))
        chunk = _padded(chunk)
        n, num_pools = len(chunk), len(chunk[0][1])
        flat = [arrays[p] for _, arrays in chunk for p in range(num_pools)]
        on_device = jax.device_put(flat, [self.host_shardings[p].with_memory_kind("device")
                                          for _ in range(n) for p in range(num_pools)])
        data = tuple(tuple(on_device[i * num_pools + p] for i in range(n)) for p in range(num_pools))
        kv, draft_kv = self._scatter(pools, np.asarray([page for page, _ in chunk], np.int32), data)
        runner.state = runner.state.replace(kv=kv, draft_kv=draft_kv)
        self.num_restored_pages += len({page for page, _ in chunk})


def host_tier(config, pool, runner, weights_named: bool = True) -> HostKVCache | None:
    """The host tier config.kv_offloading_size asks for under `pool` (its memory reserved, its copy programs
    compiled with compile_at_start), with a disk tier under it where config.kv_offloading_disk names one, or
    None. weights_named: the weights are the files config.model names (else the disk's pages last one run)."""
    if config.kv_offloading_size is None:
        return None
    if distributed.is_multiprocess():
        raise EngineConfigError("kv_offloading_size runs on one host; this engine spans "
                                f"{jax.process_count()} processes")
    layouts = page_layouts(runner.state)
    try:
        disk = None
        if config.kv_offloading_disk is not None:
            disk = DiskKVStore(config.kv_offloading_disk, int(config.kv_offloading_disk_size * GiB), layouts,
                               fingerprint(config, layouts, weights_named))
        tier = HostKVCache(int(config.kv_offloading_size * GiB), layouts, disk)
    except (ValueError, OSError) as e:
        raise EngineConfigError(f"KV offloading: {e}") from None
    pool.second_tier = tier
    seconds = tier.reserve(runner.state)
    if config.compile_at_start:
        tier.warmup(runner)
    elif disk is not None:
        tier._gathered(runner.state, [0])     # where host pages live, for pages read from disk before any save
    log.info("KV offloading: %d pages (%.2f GiB) of pinned host memory under the prefix cache (reserved in "
             "%.1f s)", tier.capacity_pages, config.kv_offloading_size, seconds)
    if disk is not None:
        log.info("KV offloading to disk: up to %d pages (%.2f GiB) in %s%s, %d found there", disk.capacity_pages,
                 config.kv_offloading_disk_size, disk.path, "" if disk.persistent else
                 " (removed at exit: the weights are not named by files)", disk.num_found)
    return tier


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


def _chunks(items: list) -> list[list]:
    return [items[i:i + CHUNK] for i in range(0, len(items), CHUNK)]


def _padded(items: list) -> list:
    """items grown to a power of two by repeating the first (one compile per size class; a repeated page is
    gathered twice, or scattered twice with the same data)."""
    n = 1 << (len(items) - 1).bit_length()
    return items + items[:1] * (n - len(items))


@jax.jit
def _gather(pools, pages):
    """Per pool: for each of pages, [2 * layers, kv heads, page_size, head_dim]."""
    return tuple(tuple(jnp.stack([x[:, page] for layer in pool for x in layer]) for page in pages)
                 for pool in pools if pool)


def _scatter(pools, pages, data):
    """pools with pages overwritten by data (per pool: one array per page, as `_gather` makes them)."""
    out, it = [], iter(data)
    for pool in pools:
        if not pool:
            out.append(pool)
            continue
        stacked = jnp.stack(next(it), axis=1)            # [2 * layers, pages, kv heads, page_size, head_dim]
        leaves = [x.at[:, pages].set(jnp.swapaxes(stacked[k], 0, 1).astype(x.dtype))
                  for k, x in enumerate(x for layer in pool for x in layer)]
        out.append(tuple(zip(leaves[0::2], leaves[1::2])))
    return tuple(out)

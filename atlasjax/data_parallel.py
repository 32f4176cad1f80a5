"""Data parallelism (`serve --data-parallel-size N`, vLLM's `-dp`, SGLang's `--dp`): N copies of the engine.

Each replica is an engine process of its own (atlasjax/engine_process.py) holding the whole model on its
own devices: on a GPU machine replica r gets the GPUs r*T .. r*T+T-1 of the visible ones (T: the tensor
parallel size) through its CUDA_VISIBLE_DEVICES; on CPU each process has its own host devices. They share
nothing but the server's process, which tokenizes and routes each request to one replica:

- to the replica that served the longest prefix of its prompt, in whole KV pages, so a conversation's next
  turn, a shared system prompt or a reasoning budget's continuation finds its pages in that replica's
  prefix cache (SGLang's cache-aware routing), unless that replica has more than `AFFINITY_SLACK` open
  requests beyond the least loaded's (or, with many open, more than half the least loaded's count beyond);
- else to the replica with the fewest open requests (the earliest of those after the last one chosen).

`routing="least-loaded"` (`--data-parallel-routing least-loaded`) skips the first rule.

Commands that concern the engine as a whole (reset the prefix cache, sleep, wake up) go to every replica;
/health, /metrics and the stats lines read their counters and gauges summed. A replica that dies fails its
own streams; the others keep serving, and /health answers 503 naming the dead one's error.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Sequence

from atlasjax.compile_cache import gpu_expected
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError, InvalidRequestError
from atlasjax.metrics import EngineStats
from atlasjax.page_pool import cache_root, page_keys
from atlasjax.profiling import profiler_dir, trace_dir
from atlasjax.speculative import SpecStats

log = logging.getLogger("atlasjax.data_parallel")

AFFINITY_SLACK = 4          # open requests a replica may have beyond the least loaded and still get its prefixes
MAX_PREFIX_ENTRIES = 1 << 17   # pages of prompts the router remembers (least recently routed forgotten first)
ROUTING = ("prefix", "least-loaded")


def visible_gpus(environ=os.environ) -> list[str] | None:
    """The GPU ids this process may hand out (its CUDA_VISIBLE_DEVICES, else what nvidia-smi lists), told
    without starting a backend; None where jax will not run on GPUs."""
    if not gpu_expected():
        return None
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        listing = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in listing.splitlines() if line.strip()]


def replica_environments(size: int, tensor_parallel_size: int, gpus: Sequence[str] | None) -> list[dict[str, str]]:
    """Each replica's extra environment: its own tensor_parallel_size GPUs of `gpus` (None: no GPUs to split,
    each replica's process has its own CPU devices)."""
    if size < 1:
        raise EngineConfigError(f"data_parallel_size must be at least 1, got {size}")
    if gpus is None:
        return [{} for _ in range(size)]
    need = size * tensor_parallel_size
    if len(gpus) < need:
        raise EngineConfigError(f"data_parallel_size={size} x tensor_parallel_size={tensor_parallel_size} needs "
                                f"{need} GPUs; {len(gpus)} visible ({','.join(gpus) or 'none'})")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tensor_parallel_size:(r + 1) * tensor_parallel_size])}
            for r in range(size)]


class PrefixRouter:
    """Picks a replica for each prompt: prefix affinity in whole pages, else the least loaded (module doc)."""

    def __init__(self, size: int, page_size: int, max_entries: int = MAX_PREFIX_ENTRIES, affinity: bool = True):
        self.size, self.page_size, self.max_entries = size, page_size, max_entries
        self.affinity = affinity     # False: by load alone ("least-loaded")
        self._owner: collections.OrderedDict[int, int] = collections.OrderedDict()   # prefix hash -> replica
        self._next = 0

    def route(self, prompt, loads: Sequence[int | None], root: int = 0) -> int:
        """The replica for `prompt` (token ids, else routed by load alone); loads: open requests per replica,
        None for one that cannot take requests; root: its pages' parent key (page_pool.cache_root: its LoRA
        adapter and cache salt). Remembers the prompt's pages as that replica's."""
        candidates = [r for r, load in enumerate(loads) if load is not None]
        if not candidates:
            raise RuntimeError("every data-parallel replica of the engine has failed")
        least = min(loads[r] for r in candidates)
        hashes = self._page_hashes(prompt, root) if self.affinity else []
        chosen = None
        for h in reversed(hashes):           # the longest prefix some replica served
            owner = self._owner.get(h)
            if owner is not None:
                if loads[owner] is not None and loads[owner] - least <= max(AFFINITY_SLACK, least // 2):
                    chosen = owner
                break
        if chosen is None:
            ring = [(r - self._next) % self.size for r in candidates if loads[r] == least]
            chosen = (min(ring) + self._next) % self.size
            self._next = (chosen + 1) % self.size
        for h in hashes:
            self._owner[h] = chosen
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return chosen

    def forget(self) -> None:
        """Drop every remembered prefix (the replicas' prefix caches were reset)."""
        self._owner.clear()

    def _page_hashes(self, prompt, root: int = 0) -> list[int]:
        """A chained hash per whole page of a token-id prompt (empty for anything else)."""
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt[:1]):
            return []
        return [hash(key) for key in page_keys([], prompt, self.page_size, root)]   # the prefix cache's page keys


class DataParallelLLM:
    """StreamingLLM's interface (generate, embed, abort, sleep / wake_up, stats, is_healthy, shutdown) over
    `size` engine processes, each with the whole model (module doc). Blocks until every replica is built;
    they build at the same time. If one fails to start, the others are stopped and its error is raised.

    max_waiting: requests each replica lets wait before refusing (503); setup: as EngineProcessLLM's;
    routing: "prefix" (prefix affinity, then load) or "least-loaded"; gpus: the GPU ids to split ("visible":
    `visible_gpus()`; None: none, each replica on its process's own devices)."""

    def __init__(self, config: EngineConfig, size: int, *, max_waiting: int = 256,
                 setup: Callable[[], None] | None = None, routing: str = "prefix",
                 gpus: Sequence[str] | None | str = "visible"):
        if routing not in ROUTING:
            raise EngineConfigError(f"data-parallel routing must be one of {', '.join(ROUTING)}, got {routing!r}")
        from atlasjax.engine_process import EngineProcessLLM  # noqa: PLC0415
        environments = replica_environments(size, config.tensor_parallel_size,
                                            visible_gpus() if gpus == "visible" else gpus)
        started: list = [None] * size

        def start(rank: int) -> None:
            try:
                started[rank] = EngineProcessLLM(config, max_waiting=max_waiting, setup=setup,
                                                 env=environments[rank])
            except BaseException as e:  # noqa: BLE001 (raised below, once every replica has answered)
                started[rank] = e
        threads = [threading.Thread(target=start, args=(r,), name=f"atlasjax-dp-start-{r}") for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failures = [(r, s) for r, s in enumerate(started) if isinstance(s, BaseException)]
        if failures:
            for s in started:
                if not isinstance(s, BaseException):
                    s.shutdown(drain=False, timeout=30)
            rank, error = failures[0]
            log.error("data-parallel replica %d of %d failed to start: %r", rank, size, error)
            raise error
        self.replicas = started
        for rank, env in enumerate(environments):
            log.info("data-parallel replica %d: engine process %d%s", rank, started[rank]._process.pid,
                     f", GPUs {env['CUDA_VISIBLE_DEVICES']}" if env else "")
        self.engine = started[0].engine    # what every replica loaded (EngineInfo)
        self.router = PrefixRouter(size, config.page_size, affinity=routing == "prefix")
        self._profiler_dir = profiler_dir(config.profiler_dir)
        self._owners: dict[str, int] = {}  # open request id -> its replica
        self._ids = 0

    # ---- what the server reads
    @property
    def size(self) -> int:
        return len(self.replicas)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self) -> EngineStats:
        return combine_stats([r.stats for r in self.replicas])

    @property
    def replica_stats(self) -> list[EngineStats]:
        return [r.stats for r in self.replicas]

    @property
    def num_pending(self) -> int:
        return sum(r.num_pending for r in self.replicas)

    @property
    def is_healthy(self) -> bool:
        return all(r.is_healthy for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        for rank, r in enumerate(self.replicas):
            if not r.is_healthy:
                return RuntimeError(f"data-parallel replica {rank}: {r.error or 'its engine process exited'}")
        return None

    def get_default_sampling_params(self):
        return self.replicas[0].get_default_sampling_params()

    # ---- requests
    def _pick(self, prompt, root: int = 0) -> int:
        return self.router.route(prompt, [r.num_pending if r.is_healthy else None for r in self.replicas], root)

    def _request_id(self, request_id: str | None, prefix: str) -> str:
        if request_id is None:
            self._ids += 1
            request_id = f"{prefix}-{self._ids}"
        return request_id

    async def generate(self, prompt, params=None, request_id: str | None = None, priority: int = 0,
                       lora_request=None, cache_salt: str | None = None) -> AsyncIterator:
        request_id = self._request_id(request_id, "req")
        if request_id in self._owners:     # (as one engine refuses it: the replicas would not see the clash)
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        rank = self._pick(prompt, cache_root(lora_request, cache_salt))
        self._owners[request_id] = rank
        deltas = self.replicas[rank].generate(prompt, params, request_id, priority, lora_request, cache_salt)
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()      # (leaving early aborts it on its replica)
            self._owners.pop(request_id, None)

    async def embed(self, prompts: list, params, request_id: str | None = None) -> list:
        return await self.replicas[self._pick(None)].embed(prompts, params, self._request_id(request_id, "embd"))

    def abort(self, request_id: str) -> None:
        rank = self._owners.get(request_id)
        if rank is not None:
            self.replicas[rank].abort(request_id)

    # ---- the engine as a whole
    def reset_prefix_cache(self) -> None:
        for r in self.replicas:
            r.reset_prefix_cache()
        self.router.forget()

    async def sleep(self, level: int = 1) -> None:
        await _on_all(r.sleep(level) for r in self.replicas)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await _on_all(r.wake_up(tags) for r in self.replicas)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> bool:
        return all(await _on_all(r.pause_generation(mode, clear_cache) for r in self.replicas))

    async def resume_generation(self) -> None:
        await _on_all(r.resume_generation() for r in self.replicas)

    async def is_paused(self) -> bool:
        return any(await asyncio.gather(*(r.is_paused() for r in self.replicas)))

    async def update_weights_from_disk(self, model_path: str) -> dict:
        """Every replica loads the checkpoint (at the same time); the slowest one's time."""
        answers = await _on_all(r.update_weights_from_disk(model_path) for r in self.replicas)
        self.router.forget()     # the replicas' prefix caches were forgotten
        return {"model_path": model_path, "seconds": max(a["seconds"] for a in answers)}

    async def start_profile(self, directory: str | None = None) -> str:
        """Every replica traces into a subdirectory `dp<N>` of `directory` (default: the engine's profiler_dir)."""
        base = trace_dir(directory, self._profiler_dir)
        await _on_all(r.start_profile(os.path.join(base, f"dp{rank}")) for rank, r in enumerate(self.replicas))
        return base

    async def stop_profile(self) -> str:
        return os.path.dirname((await _on_all(r.stop_profile() for r in self.replicas))[0])

    async def is_sleeping(self) -> bool:
        return any(await asyncio.gather(*(r.is_sleeping() for r in self.replicas)))

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop every replica (at the same time); with drain, after their in-flight requests finish."""
        threads = [threading.Thread(target=r.shutdown, args=(drain, timeout)) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


async def _on_all(calls) -> list:
    """Run one call per replica together; raise the first failure once all have answered, else their answers."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def combine_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """The replicas' counters and gauges summed; the last step's time is the longest, the LoRA adapters in use
    the union, and the per-step time window is left empty (nothing reads it across processes)."""
    total = EngineStats()
    for field in dataclasses.fields(EngineStats):
        values = [getattr(p, field.name) for p in parts]
        if field.name == "last_step_seconds":
            total.last_step_seconds = max(values, default=0.0)
        elif field.name == "spec":
            total.spec = _combine_spec(values)
        elif field.type in ("int", "float"):
            setattr(total, field.name, sum(values))
        elif field.name.endswith("_lora_adapters"):
            setattr(total, field.name, tuple(sorted(set().union(*values))))
    return total


def _combine_spec(parts: Sequence[SpecStats]) -> SpecStats:
    per_pos = [0] * max((len(p.accepted_per_pos) for p in parts), default=0)
    for p in parts:
        for j, n in enumerate(p.accepted_per_pos):
            per_pos[j] += n
    return SpecStats(sum(p.num_drafts for p in parts), sum(p.num_draft_tokens for p in parts),
                     sum(p.num_accepted_tokens for p in parts), per_pos)

"""Sleep mode (vLLM's `LLM.sleep` / `LLM.wake_up`): give the device memory an idle engine holds back to its
process, as an RL loop does while its trainer runs on the same devices, and take it again later.

Level 1 copies the weights to host memory and drops the KV pool; level 2 drops both (new weights come from
`LLM.update_params` after waking, as after a training step). Either way the cached prompt pages are
forgotten, since their K/V are gone. Waking reallocates what was dropped (`tags`: "weights", "kv_cache",
or both), with the same shapes and shardings, so the compiled steps run on as before. The engine refuses
requests while anything is missing. A speculative draft model's weights go to host memory at either level (new
weights from `update_params` are the target's only) and come back with "weights".
"""
from __future__ import annotations

import jax

from atlasjax.errors import InvalidRequestError

TAGS = ("weights", "kv_cache")


class SleepState:
    """What an engine dropped: `host_params` (level 1: the weights in host memory), `abstract_params` (their
    shapes, dtypes and shardings, for waking and for `update_params` after level 2) and which parts are out."""

    def __init__(self):
        self.asleep: set[str] = set()
        self.host_params = None
        self.abstract_params = None
        self.weights_discarded = False   # level 2: wake_up leaves the weights to update_params
        self.host_draft = None           # a draft model's weights in host memory (both levels)
        self.abstract_draft = None

    def check_awake(self) -> None:
        if self.asleep:
            raise InvalidRequestError(f"the engine is asleep ({', '.join(sorted(self.asleep))} released): call "
                                      "wake_up() first")
        if self.weights_discarded:
            raise InvalidRequestError("the engine's weights were discarded by sleep(level=2): give it weights "
                                      "with update_params() first")


def sleep(engine, level: int = 1) -> None:
    """Release the engine's weights (level 1: kept in host memory; level 2: discarded) and its KV pool."""
    if level not in (1, 2):
        raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
    if engine.has_step_in_flight or engine.scheduler.has_work:   # (requests kept by a pause hold K/V in the pool)
        raise InvalidRequestError("requests are in flight: sleep between requests")
    state, runner = engine.sleep_state, engine.runner
    if "weights" not in state.asleep and not state.weights_discarded:
        state.abstract_params = abstract(runner.params)
        state.host_params = to_host(runner.params) if level == 1 else None
        state.weights_discarded = level == 2
        delete_arrays(jax.tree.leaves(runner.params))
        runner.params = state.abstract_params
        if level == 1:
            state.asleep.add("weights")
    if runner.draft_params is not None and "draft weights" not in state.asleep:
        state.abstract_draft = abstract(runner.draft_params)
        state.host_draft = to_host(runner.draft_params)
        delete_arrays(jax.tree.leaves(runner.draft_params))
        runner.draft_params = state.abstract_draft
        state.asleep.add("draft weights")
    if "kv_cache" not in state.asleep:
        delete_arrays(jax.tree.leaves(runner.state))
        runner.state = None
        engine.pool.reset_prefix_cache()
        state.asleep.add("kv_cache")


def wake_up(engine, tags: list[str] | None = None) -> None:
    """Take back what sleep released: `tags` from "weights" and "kv_cache" (default: both)."""
    tags = list(TAGS) if tags is None else list(tags)
    if any(t not in TAGS for t in tags):
        raise InvalidRequestError(f"wake_up tags must be among {', '.join(TAGS)}, got {tags!r}")
    state, runner = engine.sleep_state, engine.runner
    if "weights" in tags and "weights" in state.asleep:
        runner.params = to_device(state.host_params, state.abstract_params)
        state.host_params = None
        state.asleep.discard("weights")
    if "weights" in tags and "draft weights" in state.asleep:
        runner.draft_params = to_device(state.host_draft, state.abstract_draft)
        state.host_draft = None
        state.asleep.discard("draft weights")
    if "kv_cache" in tags and "kv_cache" in state.asleep:
        runner.allocate(runner.num_pages)
        state.asleep.discard("kv_cache")


def abstract(params):
    """params as shapes, dtypes and shardings (what waking places host copies or new weights by)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)


def to_host(params):
    """The params copied to host memory: pinned host buffers where the platform has them (a GPU: DMA, and
    waking copies them back the same way), else numpy arrays."""
    try:
        pinned = jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), params)
        return jax.block_until_ready(jax.device_put(params, pinned))
    except (ValueError, TypeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return jax.device_get(params)


def to_device(host, abstract_params):
    """`to_host`'s copy placed back on the devices, each leaf with its `abstract` sharding."""
    return jax.tree.map(lambda h, a: jax.device_put(h, a.sharding), host, abstract_params)


def delete_arrays(arrays) -> None:
    """Free the device buffers now (not when the last reference goes), each once."""
    for x in {id(x): x for x in arrays}.values():
        if not x.is_deleted():
            x.delete()

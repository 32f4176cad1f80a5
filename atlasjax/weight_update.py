"""New weights for a running engine, as an RL or fine-tuning loop gives them: a params tree shaped as the engine's
(`install`, behind `LLM.update_params`) or a checkpoint on disk (`from_disk`, SGLang's `update_weights_from_disk`,
behind `LLM.update_weights_from_disk` and the server's POST /update_weights_from_disk).

Either way the weights keep the shapes, dtypes and shardings the engine runs, so its compiled steps stay (the
weights are their arguments), and the prefix cache is forgotten, since its K/V came from the old weights. Only
between steps with no request running: idle, or paused (atlasjax/pause.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from atlasjax import distributed, weights_summary
from atlasjax.errors import AtlasJaxError, CheckpointError, InvalidRequestError

if TYPE_CHECKING:
    from atlasjax.engine import LLMEngine

log = logging.getLogger("atlasjax.engine")


def check_can_update(engine: LLMEngine, what: str) -> None:
    """Refuse an update the engine cannot take now, with the reason."""
    if distributed.is_multiprocess():
        raise InvalidRequestError(f"{what} runs in a single-process engine")
    if engine.has_unfinished():
        raise InvalidRequestError("requests are in flight: update the weights between requests, or pause "
                                  "generation first")
    if "weights" in engine.sleep_state.asleep:
        raise InvalidRequestError("the weights are asleep in host memory: wake_up(tags=['weights']) before "
                                  "updating them (or sleep(level=2), which discards them)")


def install(engine: LLMEngine, params, source: str | None = None) -> None:
    """Run `engine` on `params`, a tree shaped as `LLM.params` (checked leaf by leaf: a mismatch is refused with
    the leaf named, the old weights still serving), placed where the current weights are. source: the checkpoint
    they were read from (for the errors)."""
    current = engine.runner.params
    old, treedef = jax.tree_util.tree_flatten_with_path(current)
    new, new_treedef = jax.tree_util.tree_flatten_with_path(params)
    if new_treedef != treedef:
        if source is not None:
            raise InvalidRequestError(f"{source} loads in other formats than the engine's weights "
                                      f"({weights_summary.describe(params)}; the engine runs "
                                      f"{weights_summary.describe(current)})")
        raise InvalidRequestError("the params' tree differs from LLM.params' (update with a tree shaped as "
                                  "LLM.params: the execution layout, q/k/v and gate/up fused)")
    for (path, a), (_, b) in zip(old, new):
        dtype = b.dtype if hasattr(b, "dtype") else np.asarray(b).dtype
        if np.shape(b) != a.shape or dtype != a.dtype:
            given = f"{dtype}{list(np.shape(b))}"
            raise InvalidRequestError(f"params{jax.tree_util.keystr(path)}: {given}, but the engine runs "
                                      f"{a.dtype}{list(a.shape)}")
    placed = [jax.device_put(b, a.sharding) for (_, a), (_, b) in zip(old, new)]
    engine.runner.params = jax.tree.unflatten(treedef, placed)
    engine.sleep_state.weights_discarded = False
    if engine.kv_offload is not None and engine.kv_offload.disk is not None:
        engine.kv_offload.disk.forget_weights()   # its files name the old weights
    for seqs in engine.requests.values():   # kept by a pause with their K/V: it came from the old weights, so
        for req in seqs:                     # their pages are nobody's prefix (until a preemption computes them again)
            if req.pages:
                req.num_registered_pages = NEVER_REGISTERED
    engine.pool.reset_prefix_cache(held_too=True)


NEVER_REGISTERED = 1 << 40   # a request's num_registered_pages that keeps its pages out of the prefix cache


def from_disk(engine: LLMEngine, model_path: str) -> dict:
    """Load the checkpoint at `model_path` (a Hugging Face directory, a .gguf file or an `LLM.save` directory of
    the engine's architecture) as the engine loaded its own: quantized by the same settings, placed over the same
    devices, fused into the execution layout. The old weights leave the device while it loads (the KV pool holds
    the memory beside them) and come back from host memory if the checkpoint cannot be read or does not fit."""
    from atlasjax.sleep_mode import abstract, delete_arrays, to_device, to_host  # noqa: PLC0415
    check_can_update(engine, "update_weights_from_disk")
    t0 = time.perf_counter()
    path = _checkpoint_path(model_path)     # no checkpoint there: refused before the weights move
    runner = engine.runner
    weights, kept = runner.params, None
    shapes = abstract(weights)
    if not engine.sleep_state.weights_discarded:    # (after sleep level 2 there are none to keep)
        kept = to_host(weights)
        delete_arrays(jax.tree.leaves(weights))
        runner.params = shapes
    del weights
    t_kept = time.perf_counter()
    try:
        params = _load(engine, path)
        t_loaded = time.perf_counter()
        install(engine, params, model_path)
    except BaseException as e:
        if kept is not None:       # the old weights serve on
            runner.params = to_device(kept, shapes)
        if isinstance(e, AtlasJaxError) or not isinstance(e, Exception):
            raise
        raise CheckpointError(f"cannot load new weights from {model_path}: {type(e).__name__}: {e}") from e
    t1 = time.perf_counter()
    log.info("new weights from %s in %.1f s (old ones to host memory %.1f s, read %.1f s, placed %.1f s)",
             model_path, t1 - t0, t_kept - t0, t_loaded - t_kept, t1 - t_loaded)
    return {"model_path": model_path, "seconds": t1 - t0, "keep_seconds": t_kept - t0,
            "read_seconds": t_loaded - t_kept, "place_seconds": t1 - t_loaded}


def _checkpoint_path(model_path: str) -> str:
    """The local path of the checkpoint `model_path` names (a Hub id resolved as at start), refused with the reason
    when nothing loadable is there."""
    from atlasjax import hub  # noqa: PLC0415
    from atlasjax.loader import model_format  # noqa: PLC0415
    if not isinstance(model_path, str) or not model_path:
        raise InvalidRequestError("model_path must name a checkpoint (a directory or a .gguf file)")
    try:
        path = hub.resolve(model_path)
        model_format(path)
    except AtlasJaxError:
        raise
    except Exception as e:  # noqa: BLE001 (a Hub lookup's failures, as the reason)
        raise CheckpointError(f"cannot find the checkpoint {model_path}: {type(e).__name__}: {e}") from e
    return path


def _load(engine: LLMEngine, model_path: str):
    """The checkpoint's params in the engine's execution layout (not placed yet where the engine's are)."""
    from atlasjax.hf_overrides import with_model_overrides  # noqa: PLC0415
    from atlasjax.model_source import load_for_engine, shard_loaded, with_weight_settings  # noqa: PLC0415
    from atlasjax.sharding import TP_AXIS  # noqa: PLC0415
    from models.fused import fuse_projections  # noqa: PLC0415
    config = dataclasses.replace(engine.config, model=model_path, load_format="auto")
    loaded = shard_loaded(load_for_engine(config, engine.dtype), config.tensor_parallel_size, engine.dtype)
    cfg = with_model_overrides(loaded.config, config.hf_overrides)
    _check_same_architecture(cfg, engine.model_config, model_path)
    params = with_weight_settings(loaded.params, config, cfg, engine.tokenizer, engine.dtype, engine.kv_dtype,
                                  engine.max_model_len, plan=loaded.plan)
    mesh = () if loaded.plan is None else (loaded.plan.mesh, TP_AXIS)
    return fuse_projections(params, *mesh, in_place=True)


def _check_same_architecture(new, current, model_path: str) -> None:
    """Refuse a checkpoint of another architecture, naming the first field that differs."""
    for name in ARCHITECTURE_FIELDS:
        a, b = getattr(current, name), getattr(new, name)
        if a != b:
            raise InvalidRequestError(f"{model_path} is another architecture: its {name} is {b!r}, the engine's "
                                      f"{a!r}")


ARCHITECTURE_FIELDS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                       "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "qk_norm")

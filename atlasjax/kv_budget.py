"""How many KV pages the engine's pool gets when `num_pages` is not given.

On a GPU: `gpu_memory_utilization` of the free device memory, less a reserve for the steps' buffers
and their compiles, and within the allocator's largest free block. The pool's arrays (one per layer
for K, one for V) must each find one free block: after a load that quantized or fused weights, the
memory its temporaries left is split into holes. Without device memory statistics (CPU): room for
every slot at full length, at most 2 GiB. Device memory figures: atlasjax/device_memory.py (the
allocator's, else the CUDA driver's).
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from atlasjax.device_memory import memory_stats

log = logging.getLogger("atlasjax.engine")


def kv_pool_pages(stats: dict, bytes_per_page: int, reserve: int, utilization: float) -> int:
    """Pages of a KV pool for device allocator `stats` (`Device.memory_stats()`): `utilization` of the
    free memory less `reserve`, and no more than the largest free block less `reserve`, since each of
    the pool's arrays needs one free block and the reserve is wanted in one piece too."""
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    budget = int((free - reserve) * utilization)
    if stats.get("largest_free_block_bytes"):
        budget = min(budget, stats["largest_free_block_bytes"] - reserve)
    return max(1, budget // bytes_per_page)


def kv_bytes_per_page(model_config, page_size: int, dtype, kv_heads: int) -> int:
    """Bytes of one page of every layer's K and V (`kv_heads` of them on this device) in `dtype`."""
    return 2 * model_config.num_layers * kv_heads * page_size * model_config.head_dim * jnp.dtype(dtype).itemsize


def auto_num_pages(config, model_config, dtype, max_model_len: int, params, plan=None, draft_config=None,
                   draft_plan=None) -> int:
    """Pages for an engine of `config` (EngineConfig) whose `params` are in their execution layout;
    under tensor parallelism (`plan`) each device holds its KV heads' share of a page. `dtype`: the pool's.
    draft_config, draft_plan: a draft model's (speculative decoding), whose own pool takes the same pages."""
    cfg, ps = model_config, config.page_size
    bytes_per_page = kv_bytes_per_page(cfg, ps, dtype, _local_kv_heads(cfg, plan))
    if draft_config is not None:
        bytes_per_page += kv_bytes_per_page(draft_config, ps, dtype, _local_kv_heads(draft_config, draft_plan))
    jax.block_until_ready(params)   # the load's temporaries are freed once its work has run
    stats = memory_stats(jax.local_devices()[0]) or {}
    if "bytes_limit" not in stats:
        want = config.max_num_seqs * -(-max_model_len // ps)
        return max(1, min(want, (2 << 30) // bytes_per_page))
    # logits and sampling, activations, and XLA's GEMM autotuner: while compiling a step it allocates
    # copies of a GEMM's operands (the LM head's weight, 1 GB at 8B shapes)
    reserve = (4 * config.max_num_seqs * cfg.vocab_size * 8 + (1 << 30) + _history_bytes(config, max_model_len)
               + max(_device_bytes(x) for x in jax.tree.leaves(params)))
    pages = kv_pool_pages(stats, bytes_per_page, reserve, config.gpu_memory_utilization)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    block = stats.get("largest_free_block_bytes")
    log.info("KV pool: %d pages of %d tokens in %s, %.2f GiB (device memory before it: %.2f GiB free of %.2f%s)",
             pages, ps, jnp.dtype(dtype).name, pages * bytes_per_page / 2**30, free / 2**30,
             stats["bytes_limit"] / 2**30, f", the largest free block {block / 2**30:.2f} GiB" if block else "")
    return pages


def _history_bytes(config, max_model_len: int) -> int:
    """The token history n-gram drafts looked up on the device read (steps.DeviceState.history), if any."""
    spec = config.speculative_config
    on_device = spec is not None and spec.ngram_on_device(config.num_scheduler_steps or 1)
    return 4 * config.max_num_seqs * max_model_len if on_device else 0


def _local_kv_heads(cfg, plan) -> int:
    """KV heads one device holds: its share under tensor parallelism (`plan`), replicas included."""
    return plan.num_kv_heads // plan.size if plan else cfg.num_kv_heads


def _device_bytes(x) -> int:
    """Bytes of one device's share of array x."""
    shards = getattr(x, "addressable_shards", None)
    return shards[0].data.nbytes if shards else getattr(x, "nbytes", 0)

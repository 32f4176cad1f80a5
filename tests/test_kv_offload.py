"""KV cache offloading (`kv_offloading_size`): prefix-cache pages the device pool evicts live on in host memory.

What a user sees: a prompt whose pages were evicted is answered as before, with its prefix reported cached
(`num_cached_tokens`) instead of computed again; a preempted request resumes from host memory; the host tier
keeps its size and empties with the prefix cache. The copies themselves run in the order the device needs
(`HostKVCache.sync`): an evicted page is saved before a refill overwrites it.
"""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError
from atlasjax.kv_offload import GiB, HostKVCache
from atlasjax.page_pool import PagePool
from serving.metrics import EngineCollector
from tests.server_util import tiny_model_dir

# 24 pages of 4 tokens: three 40-token prompts (10 pages each) cannot all stay on the device
ENGINE = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, page_size=4, num_pages=24)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts(seed: int, n: int, length: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1000, 9000, length)] for _ in range(n)]


def answer(llm, ids, params=GREEDY):
    return llm.generate({"prompt_token_ids": ids}, params)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, **ENGINE)


@pytest.fixture(scope="module")
def offload(model):
    return LLM(model, kv_offloading_size=0.01, **ENGINE)


def test_an_evicted_prefix_comes_back_from_host_memory(plain, offload):
    first, *others = prompts(0, 3)
    for llm in (plain, offload):
        llm.reset_prefix_cache()
    expected = answer(plain, first).outputs[0].token_ids
    for ids in others:            # push the first prompt's pages out of the device pool
        answer(plain, ids)
    assert answer(plain, first).num_cached_tokens == 0      # one tier: computed again

    assert answer(offload, first).outputs[0].token_ids == expected
    for ids in others:
        answer(offload, ids)
    again = answer(offload, first)
    assert again.outputs[0].token_ids == expected
    assert again.num_cached_tokens == 36                     # 9 full pages; the last token is always computed
    stats = offload.engine.stats
    assert stats.kv_offload_hits >= 9 and stats.kv_offload_saved >= 9 and stats.kv_offload_pages > 0
    assert stats.prefix_cache_hits >= stats.kv_offload_hits
    exported = {m.name: m.samples[0].value for m in EngineCollector(offload.engine).collect() if m.samples}
    assert exported["atlasjax_kv_offload_hits"] == stats.kv_offload_hits          # /metrics
    assert exported["atlasjax_kv_offload_pages_total"] == offload.engine.kv_offload.capacity_pages


def test_preempted_requests_resume_from_host_memory(plain, offload):
    batch = prompts(1, 2)            # together they outgrow the pool: one is preempted, its pages evicted
    longer = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = [answer(plain, ids, longer).outputs[0].token_ids for ids in batch]   # one at a time
    offload.reset_prefix_cache()
    preempted = offload.engine.stats.num_preemptions
    restored = offload.engine.pool.num_second_tier_hit_pages
    outs = offload.generate([{"prompt_token_ids": ids} for ids in batch], longer)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert offload.engine.stats.num_preemptions > preempted
    assert offload.engine.pool.num_second_tier_hit_pages > restored
    assert offload.engine.pool.num_free_pages == ENGINE["num_pages"]     # every page given back


def test_host_memory_keeps_the_newest_pages_up_to_its_size(model, plain):
    tier_pages = 8
    page = 2 * 2 * 2 * 4 * 16 * 4     # layers * (K, V) * kv heads * page_size * head_dim * float32 (tiny model)
    llm = LLM(model, kv_offloading_size=tier_pages * page / GiB, **ENGINE)
    tier = llm.engine.kv_offload
    assert tier.capacity_pages == tier_pages
    first, *others = prompts(2, 4)
    expected = answer(plain, first).outputs[0].token_ids
    answer(llm, first)
    for ids in others:
        answer(llm, ids)
    assert tier.num_saved_pages > tier_pages and tier.num_pages == tier_pages
    again = answer(llm, first)        # the oldest pages were dropped from host memory: computed again
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == expected
    llm.reset_prefix_cache()          # the host tier empties with the device's prefix cache
    assert tier.num_pages == 0


def test_tensor_parallel_pools_are_saved_and_restored_whole(model, plain):
    first, *others = prompts(3, 3)
    expected = answer(plain, first).outputs[0].token_ids
    llm = LLM(model, tensor_parallel_size=2, kv_offloading_size=0.01, **ENGINE)
    answer(llm, first)
    for ids in others:
        answer(llm, ids)
    again = answer(llm, first)
    assert again.num_cached_tokens == 36 and again.outputs[0].token_ids == expected


def test_a_refill_is_copied_after_the_eviction_it_replaces():
    """sync() on a one-layer pool of two one-token pages (K of page p holds p, V 10 + p): page 0 is evicted
    (B saved), rewritten, then evicted again (A) and refilled with B in one scheduling; page 1 is refilled
    with B and evicted again before the copy ran (nothing of it is saved, nothing written)."""
    pool = PagePool(2, 1)
    tier = HostKVCache(4 * 8, [((2, 1, 1, 1), np.float32)])   # four pages of K and V, one float each
    pool.second_tier = tier
    k = jnp.arange(2.0).reshape(1, 2, 1, 1)           # [kv heads, pages, page_size, head_dim]
    runner = types.SimpleNamespace(state=FakeState(kv=((k, k + 10),)))
    pool.events = [("evict", 0, ("B",))]
    tier.sync(pool, runner)
    assert ("B",) in tier
    runner.state = FakeState(kv=((k.at[:, 0].set(5.0), (k + 10).at[:, 0].set(15.0)),))   # a step wrote A
    pool.events = [("evict", 0, ("A",)), ("restore", 0, ("B",)), ("restore", 1, ("B",)), ("evict", 1, ("B",))]
    tier.sync(pool, runner)
    k, v = runner.state.kv[0]
    assert k.ravel().tolist() == [0.0, 1.0] and v.ravel().tolist() == [10.0, 11.0]
    assert [x.ravel().tolist() for x in tier.get(("A",))] == [[5.0, 15.0]]    # saved before B came back
    assert tier.num_saved_pages == 2 and tier.num_restored_pages == 1 and pool.events == []


class FakeState(types.SimpleNamespace):
    draft_kv = ()

    def replace(self, **kw):
        return FakeState(**{**vars(self), **kw})


class KeySetTier(set):
    """A second tier holding the keys in the set."""

    def claim(self, keys, limit):
        return next((i for i, key in enumerate(keys[:limit]) if key not in self), min(limit, len(keys)))


def test_pool_refills_only_a_run_after_the_device_hits():
    pool = PagePool(4, 2)
    pool.second_tier = KeySetTier({("b",), ("c",), ("x",)})
    [p] = pool.allocate(1)
    pool.register([p], [("a",)], 0, 1)
    pool.free([p])
    pages = pool.lookup([("a",), ("b",), ("c",), ("d",), ("x",)])
    assert pages[0] == p and len(pages) == 3                   # a on the device, b and c from host, not x past d
    assert [e[0] for e in pool.events] == ["restore", "restore"] and pool.num_second_tier_hit_pages == 2
    assert pool.num_hit_pages == 3 and pool.lookup([("b",)]) == [pages[1]]   # refilled pages are cached


def test_bad_settings_are_refused_before_loading():
    for size in (0, -1.0, True, "4"):
        with pytest.raises(EngineConfigError, match="kv_offloading_size"):
            EngineConfig(kv_offloading_size=size)
    with pytest.raises(EngineConfigError, match="prefix caching"):
        EngineConfig(kv_offloading_size=4, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no page"):
        HostKVCache(100, [((4, 2, 16, 64), np.float32)])
    with pytest.raises(EngineConfigError, match="exceeds this host's"):
        LLM("/nonexistent", kv_offloading_size=1 << 20)     # a PiB: refused before the model is looked for


def test_the_cli_flag_reaches_the_config():
    import argparse

    from atlasjax.__main__ import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert EngineConfig(**engine_kwargs(p.parse_args(["--kv-offloading-size", "2.5"]))).kv_offloading_size == 2.5
    assert engine_kwargs(p.parse_args([]))["kv_offloading_size"] is None
    config = EngineConfig(**engine_kwargs(p.parse_args(["--kv-offloading-size", "2", "--kv-offloading-disk", "/d",
                                                        "--kv-offloading-disk-size", "100"])))
    assert (config.kv_offloading_disk, config.kv_offloading_disk_size) == ("/d", 100)


def test_the_start_warmup_compiles_the_copies_without_changing_the_pool(plain, offload):
    """What compile_at_start (serve) runs: page 0 copied out and back in every chunk size."""
    first, *others = prompts(4, 3)
    expected = answer(plain, first).outputs[0].token_ids
    offload.reset_prefix_cache()
    answer(offload, first)                       # its pages stay cached on the device
    offload.engine.kv_offload.warmup(offload.engine.runner)
    assert offload.engine.kv_offload.num_pages == 0
    assert answer(offload, first).outputs[0].token_ids == expected
    for ids in others:
        answer(offload, ids)
    again = answer(offload, first)
    assert again.num_cached_tokens == 36 and again.outputs[0].token_ids == expected

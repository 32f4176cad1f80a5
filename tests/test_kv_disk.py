"""KV offloading to disk (`kv_offloading_disk`): pages host memory drops are read back from files, and the files
outlive the engine: a new engine on the same weights answers a prompt an earlier one computed with its prefix
cached. A damaged file costs only its page (computed again), the files keep their size bound, and engines of
other weights or settings never read each other's pages."""
from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest

from atlasjax import LLM, SamplingParams, kv_offload
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError
from atlasjax.kv_disk import SUFFIX, DiskKVStore, fingerprint, key_digest
from atlasjax.kv_offload import GiB
from atlasjax.page_pool import page_keys
from serving.metrics import EngineCollector
from tests.server_util import tiny_model_dir

PAGE_BYTES = 2 * 2 * 2 * 4 * 16 * 4   # layers * (K, V) * kv heads * page_size * head_dim * float32 (tiny model)
# 24 device pages of 4 tokens and 8 in host memory: 40-token prompts are pushed out of both by three others
ENGINE = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, page_size=4, num_pages=24,
              kv_offloading_size=8 * PAGE_BYTES / GiB, kv_offloading_disk_size=0.001)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts(seed: int, n: int, length: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1000, 9000, length)] for _ in range(n)]


def answer(llm, ids):
    return llm.generate({"prompt_token_ids": ids}, GREEDY)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


def test_pages_come_back_from_disk_in_this_engine_and_the_next(model, tmp_path):
    first, second, *others = prompts(0, 5)
    llm = LLM(model, kv_offloading_disk=str(tmp_path), **ENGINE)
    expected = [answer(llm, ids).outputs[0].token_ids for ids in (first, second)]   # computed: nothing cached
    for ids in others:                 # pushes both out of the device pool and out of host memory
        answer(llm, ids)
    tier = llm.engine.kv_offload
    assert tier.disk.flush(timeout=60) and tier.disk.persistent
    again = answer(llm, first)
    assert again.num_cached_tokens == 36 and again.outputs[0].token_ids == expected[0]
    assert llm.engine.stats.kv_offload_disk_reads >= 9       # host memory had dropped them: read from files
    assert tier.disk.flush(timeout=60)

    # A new engine on the same weights and settings finds the files; one of them damaged is computed again.
    damaged = page_keys([], second, ENGINE["page_size"])[4]
    with open(os.path.join(tier.disk.path, key_digest(damaged) + SUFFIX), "r+b") as f:
        f.truncate(PAGE_BYTES // 2)
    later = LLM(model, kv_offloading_disk=str(tmp_path), **ENGINE)
    assert later.engine.kv_offload.disk.path == tier.disk.path
    out = answer(later, second)
    assert out.num_cached_tokens == 16 and out.outputs[0].token_ids == expected[1]   # pages 0-3, then the damage
    out = answer(later, first)
    assert out.num_cached_tokens == 36 and out.outputs[0].token_ids == expected[0]
    exported = {m.name: m.samples[0].value for m in EngineCollector(later.engine).collect() if m.samples}
    assert exported["atlasjax_kv_offload_disk_reads"] == later.engine.stats.kv_offload_disk_reads >= 13
    assert exported["atlasjax_kv_offload_disk_pages_total"] == later.engine.kv_offload.disk.capacity_pages
    assert later.engine.pool.num_free_pages == ENGINE["num_pages"]      # every page given back

    later.reset_prefix_cache()        # the files go with the prefix cache
    assert later.engine.kv_offload.disk.num_pages == 0
    assert not [n for n in os.listdir(tier.disk.path) if n.endswith(SUFFIX)]
    before = llm.engine.stats.kv_offload_disk_reads
    assert answer(llm, second).outputs[0].token_ids == expected[1]       # the first engine: files gone, a miss
    assert llm.engine.stats.kv_offload_disk_reads == before


def test_a_prompt_whose_prefix_is_read_from_disk_waits_while_others_run(model, tmp_path, monkeypatch):
    """The files are read in the background: a request whose prefix lies only on disk waits in the queue while
    others are scheduled, and runs with its prefix cached once the reads land. One aborted meanwhile leaks
    nothing."""
    first, second, fresh, *others = prompts(1, 6)
    llm = LLM(model, kv_offloading_disk=str(tmp_path), **ENGINE)
    expected = [answer(llm, ids).outputs[0].token_ids for ids in (first, second)]
    for ids in others:                 # both pushed out of the device pool and out of host memory
        answer(llm, ids)
    engine, tier = llm.engine, llm.engine.kv_offload
    assert tier.disk.flush(timeout=60)

    gate, load = threading.Event(), DiskKVStore._load
    monkeypatch.setattr(DiskKVStore, "_load", lambda *args: gate.wait(60) and load(*args))   # a slow disk
    engine.add_request("slow", first, GREEDY)
    engine.add_request("gone", second, GREEDY)
    engine.add_request("fresh", fresh, GREEDY)
    streamed: dict[str, list[int]] = {}
    for _ in range(200):
        deltas = engine.step()
        for d in deltas:
            streamed.setdefault(d.request_id, []).extend(d.new_token_ids)
        if any(d.finished for d in deltas):
            break
    assert list(streamed) == ["fresh"] and len(streamed["fresh"]) == GREEDY.max_tokens   # not held up
    assert tier.num_reading >= 18 and engine.stats.kv_offload_disk_reading == tier.num_reading
    exported = {m.name: m.samples[0].value for m in EngineCollector(engine).collect() if m.samples}
    assert exported["atlasjax_kv_offload_disk_reading_pages"] == tier.num_reading
    assert engine.abort("gone")

    gate.set()
    while engine.has_unfinished():
        for d in engine.step():
            streamed.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finished and d.request_id == "slow":
                assert d.num_cached_tokens == 36                  # its prefix came from the files
    assert streamed["slow"] == expected[0] and "gone" not in streamed
    for rid in list(engine.requests):
        engine.release(rid)
    assert tier.num_reading == 0 and engine.pool.num_free_pages == ENGINE["num_pages"]
    assert answer(llm, second).outputs[0].token_ids == expected[1]   # the aborted one's pages, read, serve later


def test_a_stalled_disk_read_is_given_up_and_the_prefix_computed(model, tmp_path, monkeypatch):
    first, *others = prompts(2, 5)
    llm = LLM(model, kv_offloading_disk=str(tmp_path), **ENGINE)
    expected = answer(llm, first).outputs[0].token_ids
    for ids in others:
        answer(llm, ids)
    assert llm.engine.kv_offload.disk.flush(timeout=60)
    gate, load = threading.Event(), DiskKVStore._load
    monkeypatch.setattr(DiskKVStore, "_load", lambda *args: gate.wait(60) and load(*args))   # a disk that hangs
    monkeypatch.setattr(kv_offload, "FETCH_SECONDS", 0.5)
    out = answer(llm, first)
    assert out.outputs[0].token_ids == expected and out.num_cached_tokens == 0   # computed after half a second
    gate.set()
    assert llm.engine.pool.num_free_pages == ENGINE["num_pages"]


def store(tmp_path, pages: int, name: str | None = "fp") -> DiskKVStore:
    return DiskKVStore(str(tmp_path), pages * 8, [((2,), np.float32)], name)   # pages of two floats


def test_the_files_keep_their_size_and_least_recently_used_go_first(tmp_path):
    disk = store(tmp_path, 3)
    for i in range(4):
        disk.put(("k", i), (np.array([i, -i], np.float32),))
        if i == 2:
            assert disk.flush(timeout=10)
            assert disk.get(("k", 0))[0].tolist() == [0.0, 0.0]     # read: now the most recently used
    assert disk.flush(timeout=10)
    assert ("k", 1) not in disk and [("k", i) in disk for i in (0, 2, 3)] == [True] * 3
    assert sorted(os.listdir(disk.path)) == sorted(key_digest(("k", i)) + SUFFIX for i in (0, 2, 3))
    assert disk.get(("k", 1)) is None and disk.num_written == 4

    again = store(tmp_path, 2)         # a smaller store on the same files keeps the newest
    assert again.num_found == 2 and ("k", 3) in again and ("k", 2) not in again
    disk.put(("k", 4), (np.full(2, 4.0, np.float32),))   # written by one engine while another runs
    assert disk.flush(timeout=10)
    assert again.get(("k", 4))[0].tolist() == [4.0, 4.0] and ("k", 4) in again

    disk.forget_weights()              # update_params: later pages under a namespace of their own
    assert not disk.persistent and ("k", 3) not in disk
    disk.put(("k", 5), (np.ones(2, np.float32),))
    disk.close()
    assert not os.path.exists(disk.path)   # removed at exit


def test_other_weights_or_settings_name_other_files(model, tmp_path):
    config = EngineConfig(model=model, kv_offloading_disk=str(tmp_path), **ENGINE)
    layouts = [((4, 2, 4, 16), np.dtype(np.float32))]
    name = fingerprint(config, layouts, True)
    assert name == fingerprint(dataclasses.replace(config, max_num_seqs=8), layouts, True)   # not in the bytes
    assert fingerprint(config, layouts, False) is None             # weights given in memory: no file names them
    for changed in (dataclasses.replace(config, kv_cache_dtype="fp8"), dataclasses.replace(config, seed=1)):
        assert fingerprint(changed, layouts, True) != name
    assert fingerprint(config, [((4, 2, 8, 16), np.dtype(np.float32))], True) != name
    weights = os.path.join(model, "model.safetensors")
    os.utime(weights, ns=(os.stat(weights).st_atime_ns, os.stat(weights).st_mtime_ns + 1))
    assert fingerprint(config, layouts, True) != name               # the weight file changed


def test_bad_settings_are_refused_before_loading(tmp_path):
    with pytest.raises(EngineConfigError, match="needs kv_offloading_size"):
        EngineConfig(kv_offloading_disk=str(tmp_path), kv_offloading_disk_size=1)
    for size in (None, 0, True, "4"):
        with pytest.raises(EngineConfigError, match="kv_offloading_disk_size"):
            EngineConfig(kv_offloading_size=1, kv_offloading_disk=str(tmp_path), kv_offloading_disk_size=size)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(EngineConfigError, match="kv_offloading_disk"):
        LLM("/nonexistent", kv_offloading_size=0.01, kv_offloading_disk=str(blocker), kv_offloading_disk_size=1)

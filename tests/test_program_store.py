"""The program store (atlasjax/program_store.py): a restarted engine loads its compiled step programs
instead of lowering and compiling them, answers the same, and a damaged entry is compiled again.

The store is for GPUs; these CPU tests switch it on ($ATLASJAX_PROGRAM_STORE=on) and restart from one
writing process, the case XLA CPU executables load correctly in (see the module's docstring). Programs of
two writing processes loaded together were checked on an H100 (notebooks/gpu_program_store_writers.sh)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from atlasjax import program_store
from atlasjax.program_store import ProgramStore

# A process that starts an engine on the tiny preset with the compilation cache in argv[1] (tensor
# parallel over argv[2] CPU devices) and prints what it compiled, what it loaded and its greedy tokens.
ENGINE_PROCESS = textwrap.dedent("""
    import json, sys
    import jax.numpy as jnp
    from atlasjax import LLM, SamplingParams, compile_cache
    from atlasjax.bench.presets import load_preset
    from atlasjax.engine import LLMEngine
    from atlasjax.engine_config import EngineConfig
    compile_cache.enable(sys.argv[1])
    tp = int(sys.argv[2])
    config = EngineConfig(tensor_parallel_size=tp, max_num_seqs=2, max_model_len=64, page_size=16,
                          max_num_batched_tokens=32, compile_at_start=True, num_scheduler_steps=2)
    llm = LLM.from_engine(LLMEngine(config, loaded=load_preset("tiny", jnp.float32, tensor_parallel_size=tp)))
    runner = llm.engine.runner
    outs = llm.generate([[1, 2, 3], list(range(5, 40))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                         logprobs=1))
    print(json.dumps({"compiled": runner.num_compiles, "loaded": runner.num_loaded,
                      "tokens": [o.outputs[0].token_ids for o in outs],
                      "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                   for o in outs]}))
""")


def _start(cache, tp: int = 1, **env) -> dict:
    run = subprocess.run([sys.executable, "-c", ENGINE_PROCESS, str(cache), str(tp)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "ATLASJAX_COMPILATION_CACHE": str(cache),
                                           program_store.ENV: "on", **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_restart_loads_every_step_program_and_answers_the_same(tmp_path, tp):
    first = _start(tmp_path, tp)
    assert first["compiled"] > 0 and first["loaded"] == 0
    stored = sorted(p.name for p in (tmp_path / "programs").iterdir())
    assert len(stored) == first["compiled"]                # one entry per step program

    second = _start(tmp_path, tp)
    assert second["compiled"] == 0, "a restart compiled programs the store holds"
    assert second["loaded"] == first["compiled"]
    assert second["tokens"] == first["tokens"]
    np.testing.assert_allclose(second["logprobs"], first["logprobs"], atol=1e-6)
    assert sorted(p.name for p in (tmp_path / "programs").iterdir()) == stored


def test_switched_off_the_restart_compiles(tmp_path):
    _start(tmp_path)
    again = _start(tmp_path, ATLASJAX_PROGRAM_STORE="off")
    assert again["loaded"] == 0 and again["compiled"] > 0


def test_a_damaged_entry_is_dropped_and_compiled_again(tmp_path):
    first = _start(tmp_path)
    entries = sorted((tmp_path / "programs").iterdir())
    entries[0].write_bytes(b"not a program")
    entries[1].write_bytes(entries[1].read_bytes()[:1000])   # cut short
    second = _start(tmp_path)
    assert second["compiled"] == 2 and second["loaded"] == first["compiled"] - 2
    assert second["tokens"] == first["tokens"]
    np.testing.assert_allclose(second["logprobs"], first["logprobs"], atol=1e-6)
    # dropped; on a CPU not written again by a process that loaded programs
    assert sorted((tmp_path / "programs").iterdir()) == entries[2:]


def test_a_cpu_program_compiled_after_loads_is_not_written(tmp_path):
    store = ProgramStore(tmp_path, platform="cpu")
    store.num_loaded = 1
    assert not store.save("k", object())            # refused before serializing anything
    assert not any(tmp_path.iterdir())
    assert ProgramStore(tmp_path, platform="gpu").writes_after_loads


def _key(store, step=("decode", 8), rows=8, fn=np.add, donate=(1,), options=None):
    args = ({"w": jax.ShapeDtypeStruct((rows, 4), np.float32)}, np.zeros(rows, np.int32))
    return store.key(step, fn, donate, args, options or {})


def test_the_key_changes_with_what_the_program_is_made_from(tmp_path, monkeypatch):
    store = ProgramStore(tmp_path)
    base = _key(store)
    assert _key(store) == base
    assert _key(store, step=("decode", 16)) != base
    assert _key(store, rows=16) != base
    assert _key(store, fn=np.subtract) != base
    assert _key(store, donate=()) != base
    assert _key(store, options={"xla_gpu_graph_min_graph_size": "1"}) != base
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "off")     # a switch that changes what a step traces
    program_store.environment_digest.cache_clear()
    try:
        assert _key(store) != base
    finally:
        monkeypatch.delenv("ATLASJAX_DECODE_MATMUL")
        program_store.environment_digest.cache_clear()
    assert _key(store) == base


def test_a_step_function_is_described_without_addresses():
    import functools

    from atlasjax.sampling import FULL
    described = program_store.describe(functools.partial(np.add, FULL, (3, 4), num=2))
    assert "0x" not in described and "numpy.add" in described and repr(FULL) in described


def test_the_least_recently_used_entries_go_past_the_cap(tmp_path):
    import time

    store = ProgramStore(tmp_path, max_bytes=2500)
    for i in range(3):
        (tmp_path / f"k{i}{program_store.SUFFIX}").write_bytes(b"x" * 1000)
        os.utime(tmp_path / f"k{i}{program_store.SUFFIX}", (time.time() - 100 + i, time.time() - 100 + i))
    (tmp_path / "stale.tmp").write_bytes(b"x")               # a write cut off by a stopped process
    os.utime(tmp_path / "stale.tmp", (time.time() - 7200, time.time() - 7200))
    (tmp_path / "fresh.tmp").write_bytes(b"x")               # another process writing now
    store._evict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.tmp", f"k1{program_store.SUFFIX}",
                                                          f"k2{program_store.SUFFIX}"]


def test_the_store_follows_the_compilation_cache_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv(program_store.ENV, raising=False)
    assert not program_store.enabled("cpu") and program_store.enabled("gpu")
    assert program_store.store_in(str(tmp_path)) is None               # this CPU: off unless asked for
    monkeypatch.setenv(program_store.ENV, "on")
    assert program_store.enabled("cpu")
    assert program_store.store_in(None) is None
    assert program_store.store_in("gs://bucket/cache") is None          # jax's cache can be remote; the store not
    store = program_store.store_in(str(tmp_path), 123)
    assert store.directory == tmp_path / "programs" and store.max_bytes == 123
    monkeypatch.setenv(program_store.ENV, "off")
    assert not program_store.enabled("gpu")
    assert program_store.store_in(str(tmp_path)) is None
    assert program_store.from_jax_config() is None


def test_an_unreadable_entry_is_logged_not_raised(tmp_path, caplog):
    store = ProgramStore(tmp_path)
    (tmp_path / f"abc{program_store.SUFFIX}").write_bytes(b"\x80\x04garbage")
    with caplog.at_level(logging.WARNING, logger="atlasjax.compile"):
        assert store.load("abc", jax.devices()[:1]) is None
    assert "dropping unreadable" in caplog.text
    assert not (tmp_path / f"abc{program_store.SUFFIX}").exists()
    assert store.load("missing", jax.devices()[:1]) is None


def test_a_step_that_would_key_on_an_address_is_not_stored(tmp_path):
    import functools

    store = ProgramStore(tmp_path)
    assert _key(store, fn=functools.partial(np.add, object())) is None

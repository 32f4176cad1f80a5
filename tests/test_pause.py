"""Pausing generation for new weights (atlasjax/pause.py, atlasjax/weight_update.py), as an RL loop drives it
between rollouts: each pause mode does what it says to the requests in flight ("abort" ends them with what they
generated, "wait" lets them finish, "keep" freezes and continues them), requests arriving meanwhile wait for the
resume, no page leaks, and `update_weights_from_disk` makes the engine answer as one built on the new checkpoint,
without compiling again, while a checkpoint it cannot take is refused with the reason and the old weights serve on."""
from __future__ import annotations

import os
import shutil

import jax
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.errors import AtlasJaxError, InvalidRequestError
from tests.hf_models import make_hf_model

KW = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)
PROMPTS = {"a": list(range(5, 45)), "b": list(range(50, 70))}
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Two checkpoints of one architecture (different random weights), and one of another architecture."""
    out = {}
    for name, case, seed in (("first", "llama_gqa4", 0), ("second", "llama_gqa4", 1), ("other", "llama_tied_mha", 0)):
        out[name] = str(tmp_path_factory.mktemp(name))
        make_hf_model(case, out[name], seed=seed)
    return out


@pytest.fixture(scope="module")
def llm(dirs):
    return LLM(dirs["first"], **KW)


@pytest.fixture(scope="module")
def second(dirs):
    return LLM(dirs["second"], **KW)


def _greedy(llm, prompt, max_tokens=MAX_TOKENS) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].token_ids


def _steps(engine, out: dict, n: int | None = None) -> None:
    """Run n steps (None: until the engine has nothing to step), gathering each request's tokens and finish."""
    while engine.has_unfinished() and (n is None or n > 0):
        _gather(out, engine.step())
        n = None if n is None else n - 1


def _gather(out: dict, deltas) -> None:
    for d in deltas:
        tokens, _ = out.get(d.request_id, ([], None))
        out[d.request_id] = (tokens + d.new_token_ids, d.finish_reason)


def _release_all(engine) -> None:
    for rid in list(engine.requests):
        engine.release(rid)


def test_abort_ends_the_requests_in_flight_and_holds_later_ones_until_resume(llm):
    engine = llm.engine
    want = {rid: _greedy(llm, p) for rid, p in PROMPTS.items()}
    free = engine.pool.num_free_pages
    out = {}
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    _steps(engine, out, 3)
    _gather(out, engine.pause_generation("abort"))
    assert engine.pause_state.settled and engine.is_paused
    for rid in PROMPTS:
        tokens, reason = out[rid]
        assert reason == "abort" and 0 < len(tokens) < MAX_TOKENS
        assert tokens == want[rid][:len(tokens)]          # what they generated, kept
    _release_all(engine)
    assert engine.pool.num_free_pages == free              # no page leaked
    engine.add_request("later", PROMPTS["a"], GREEDY)
    assert not engine.has_unfinished() and engine.step() == []   # it waits for the resume
    assert "later" not in out
    engine.resume_generation()
    assert not engine.is_paused
    _steps(engine, out)
    assert out["later"] == (want["a"], "length")
    _release_all(engine)
    assert engine.pool.num_free_pages == free


def test_wait_lets_the_requests_in_flight_finish_first(llm):
    engine = llm.engine
    want = _greedy(llm, PROMPTS["a"])
    out = {}
    engine.add_request("early", PROMPTS["a"], GREEDY)
    _steps(engine, out, 2)
    assert engine.pause_generation("wait") == [] and not engine.pause_state.settled
    engine.add_request("late", PROMPTS["b"], GREEDY)
    _steps(engine, out)
    assert out["early"] == (want, "length")
    assert "late" not in out and engine.pause_state.settled
    engine.resume_generation()
    _steps(engine, out)
    assert out["late"] == (_greedy(llm, PROMPTS["b"]), "length")
    _release_all(engine)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_keep_freezes_the_requests_and_resume_continues_them(llm, clear_cache):
    engine = llm.engine
    want = _greedy(llm, PROMPTS["a"])
    preemptions = engine.scheduler.num_preemptions
    out = {}
    engine.add_request("kept", PROMPTS["a"], GREEDY)
    _steps(engine, out, 3)
    _gather(out, engine.pause_generation("keep", clear_cache=clear_cache))   # (the step in flight, read back)
    assert engine.pause_state.settled and out["kept"][1] is None
    assert not engine.has_unfinished() and engine.step() == []
    engine.resume_generation()
    _steps(engine, out)
    assert out["kept"] == (want, "length")                 # the same tokens as without the pause
    # clear_cache drops the kept request's K/V: it computes it again at resume
    assert (engine.scheduler.num_preemptions > preemptions) == clear_cache
    _release_all(engine)


def test_new_weights_during_a_keep_pause_make_every_later_token(llm, second, dirs):
    """keep with clear_cache (SGLang's "retract"): the tokens after the resume are those the new weights give for
    the prompt and the tokens before the pause; then the engine answers as the second checkpoint's, and back."""
    engine = llm.engine
    compiles = engine.runner.num_compiles
    out = {}
    engine.add_request("rollout", PROMPTS["a"], GREEDY)
    _steps(engine, out, 3)
    _gather(out, engine.pause_generation("keep", clear_cache=True))
    before = out["rollout"][0]
    assert 0 < len(before) < MAX_TOKENS
    loaded = engine.update_weights_from_disk(dirs["second"])
    assert loaded["seconds"] > 0
    engine.resume_generation()
    _steps(engine, out)
    _release_all(engine)
    tokens, reason = out["rollout"]
    assert reason == "length" and tokens[:len(before)] == before
    assert tokens[len(before):] == _greedy(second, PROMPTS["a"] + before, MAX_TOKENS - len(before))
    assert _greedy(llm, PROMPTS["b"]) == _greedy(second, PROMPTS["b"])
    assert engine.runner.num_compiles == compiles
    llm.update_weights_from_disk(dirs["first"])
    assert _greedy(llm, PROMPTS["b"]) == _greedy(LLM.from_engine(engine), PROMPTS["b"])


def test_kept_pages_from_the_old_weights_serve_no_later_prompt(llm, second, dirs):
    """keep without clear_cache (partial rollouts): the kept request goes on over its old K/V, but a later prompt
    of the same prefix computes its own with the new weights."""
    engine = llm.engine
    out = {}
    engine.add_request("partial", PROMPTS["a"], GREEDY)
    _steps(engine, out, 3)
    engine.pause_generation("keep", clear_cache=False)
    llm.update_weights_from_disk(dirs["second"])
    engine.resume_generation()
    _steps(engine, out)
    assert out["partial"][1] == "length"
    _release_all(engine)
    fresh = llm.generate([PROMPTS["a"]], GREEDY)[0]
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == _greedy(second, PROMPTS["a"])
    llm.update_weights_from_disk(dirs["first"])


def test_quantized_engine_takes_the_checkpoint_quantized_as_its_own(llm, dirs, tmp_path):
    first = LLM(dirs["first"], quantization="int8", **KW)
    before = _greedy(first, PROMPTS["a"])
    saved = str(tmp_path / "int8")
    first.save(saved)                                   # quantized once: taken back as it is
    first.update_weights_from_disk(dirs["second"])
    want = LLM(dirs["second"], quantization="int8", **KW)
    assert first.engine.weights_summary == want.engine.weights_summary
    assert _greedy(first, PROMPTS["a"]) == _greedy(want, PROMPTS["a"])
    first.update_weights_from_disk(saved)
    assert _greedy(first, PROMPTS["a"]) == before
    want = _greedy(llm, PROMPTS["a"])
    with pytest.raises(InvalidRequestError, match="loads in other formats than the engine's weights .*int8"):
        llm.update_weights_from_disk(saved)           # int8 weights saved as such, for an engine running floats
    assert _greedy(llm, PROMPTS["a"]) == want


def test_under_tensor_parallelism_and_after_sleep_level_2(dirs, second):
    """The checkpoint is split over the engine's devices as its own weights were; after sleep(level=2), which
    discards the weights, it gives the engine its weights again."""
    tp = LLM(dirs["first"], tensor_parallel_size=2, **KW)
    shardings = [x.sharding for x in jax.tree.leaves(tp.params)]
    tp.update_weights_from_disk(dirs["second"])
    assert [x.sharding for x in jax.tree.leaves(tp.params)] == shardings
    assert _greedy(tp, PROMPTS["a"]) == _greedy(second, PROMPTS["a"])
    tp.sleep(level=2)
    tp.wake_up()
    tp.update_weights_from_disk(dirs["first"])
    assert _greedy(tp, PROMPTS["a"]) == _greedy(LLM(dirs["first"], **KW), PROMPTS["a"])


def test_a_checkpoint_it_cannot_take_is_refused_and_the_old_weights_serve_on(llm, dirs, tmp_path):
    want = _greedy(llm, PROMPTS["a"])
    with pytest.raises(InvalidRequestError, match="another architecture: its num_heads is 4, the engine's 8"):
        llm.update_weights_from_disk(dirs["other"])
    broken = str(tmp_path / "broken")
    shutil.copytree(dirs["second"], broken)
    weights = os.path.join(broken, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(AtlasJaxError):
        llm.update_weights_from_disk(broken)
    with pytest.raises(AtlasJaxError):
        llm.update_weights_from_disk(str(tmp_path / "missing"))
    assert _greedy(llm, PROMPTS["a"]) == want
    llm.engine.add_request("busy", PROMPTS["b"], GREEDY)
    with pytest.raises(InvalidRequestError, match="in flight"):
        llm.update_weights_from_disk(dirs["second"])
    with pytest.raises(InvalidRequestError, match="pause mode"):
        llm.engine.pause_generation("freeze")
    llm.engine.pause_generation("keep", clear_cache=False)
    with pytest.raises(InvalidRequestError, match="in flight"):
        llm.sleep()                                     # the kept request's K/V lives in the pool
    llm.engine.resume_generation()
    _steps(llm.engine, {})
    _release_all(llm.engine)
    assert _greedy(llm, PROMPTS["a"]) == want

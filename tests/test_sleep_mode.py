"""Sleep mode (`LLM.sleep` / `LLM.wake_up`, vLLM's): an idle engine gives its device memory back (the weights
to host memory at level 1, discarded at level 2; the KV pool dropped), refuses requests while asleep, and
answers after waking exactly as before, without compiling again; level 2 takes new weights through
`update_params`."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.errors import InvalidRequestError
from tests.hf_models import make_hf_model

KW = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)
PROMPT = list(range(5, 45))
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sleepy"))
    make_hf_model("llama_gqa4", d)
    return LLM(d, **KW)


def _device_bytes() -> int:
    """Bytes of the live jax arrays in device memory (a sleeping engine's weights live in host memory)."""
    return sum(x.nbytes for x in jax.live_arrays()
               if not x.is_deleted() and x.sharding.memory_kind in (None, "device"))


def _tokens(llm):
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_level_1_frees_the_device_memory_and_wakes_to_the_same_answers(llm):
    before = _tokens(llm)
    compiles = llm.engine.runner.num_compiles
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.params))
    kv_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.state))
    held = _device_bytes()
    llm.sleep(level=1)
    assert llm.is_sleeping
    assert held - _device_bytes() >= params_bytes + kv_bytes
    with pytest.raises(InvalidRequestError, match="asleep"):
        llm.generate([PROMPT], GREEDY)
    with pytest.raises(InvalidRequestError, match="asleep"):
        llm.embed([PROMPT])
    llm.wake_up(tags=["weights"])                  # vLLM's order: weights first, the pool last
    assert llm.is_sleeping
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping
    assert _tokens(llm) == before
    assert llm.engine.runner.num_compiles == compiles
    assert llm.generate([PROMPT], GREEDY)[0].num_cached_tokens > 0    # the prefix cache works again


def test_level_2_takes_new_weights_after_waking(llm):
    before = _tokens(llm)
    weights = jax.device_get(llm.params)           # what a trainer would hand back
    llm.sleep(level=2)
    with pytest.raises(InvalidRequestError, match="asleep"):
        llm.generate([PROMPT], GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping
    with pytest.raises(InvalidRequestError, match="discarded"):
        llm.generate([PROMPT], GREEDY)
    llm.update_params(weights)
    assert _tokens(llm) == before


def test_bad_sleep_calls_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(InvalidRequestError, match="tags"):
        llm.wake_up(tags=["everything"])
    llm.sleep(level=1)
    llm.sleep(level=1)                              # twice: nothing more to release
    with pytest.raises(InvalidRequestError, match="wake_up"):
        llm.update_params(jax.tree.map(np.asarray, llm.engine.sleep_state.host_params))
    llm.wake_up()
    llm.wake_up()                                   # awake already: nothing to do
    assert len(_tokens(llm)) == GREEDY.max_tokens


def test_a_server_with_sleep_mode_sleeps_and_wakes(request, tmp_path_factory):
    """`serve --enable-sleep-mode`: POST /sleep, GET /is_sleeping, POST /wake_up (vLLM's); a request while
    asleep gets a 400 naming the cause, and the answer after waking is the one before."""
    import httpx

    from tests.server_util import shared_server
    server = shared_server(request, tmp_path_factory, "sleep", "--enable-sleep-mode")
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/sleep", params={"level": "1"}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400 and "asleep" in r.json()["error"]["message"]
        assert http.post("/sleep", params={"level": "9"}).status_code == 400
        assert http.post("/wake_up", params={"tags": "bogus"}).status_code == 400
        assert http.post("/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")]).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
        assert http.get("/health").json()["status"] == "ok"
        # SGLang's names for the same (RL frameworks colocating a trainer): weights and KV cache go together
        r = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert r.status_code == 400 and "alone" in r.json()["error"]["message"]
        assert http.post("/release_memory_occupation", json={}).json()["success"]
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}      # the KV cache is still released
        assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == before


def test_a_draft_models_weights_sleep_in_host_memory_at_both_levels(tmp_path_factory):
    """Speculative decoding with a draft model: its weights leave the device with the target's (to host memory at
    either level: update_params gives the target's only) and come back with "weights"; the answers stay the same."""
    d = str(tmp_path_factory.mktemp("draft"))
    make_hf_model("llama_gqa4", d)
    llm = LLM(d, speculative_config={"model": d, "num_speculative_tokens": 3}, **KW)
    before = _tokens(llm)
    params = jax.tree.map(np.asarray, llm.params)
    draft = llm.engine.runner.draft_params
    for level in (1, 2):
        llm.sleep(level=level)
        assert all(x.is_deleted() for x in jax.tree.leaves(draft))
        with pytest.raises(InvalidRequestError, match="asleep"):
            llm.generate([PROMPT], GREEDY)
        llm.wake_up()
        if level == 2:
            llm.update_params(params)
        assert _tokens(llm) == before
        spec = llm.engine.stats.spec
        assert spec.num_accepted_tokens == spec.num_draft_tokens > 0   # the draft drafts as before: all accepted
        draft = llm.engine.runner.draft_params

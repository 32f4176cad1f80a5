"""n-gram drafts looked up on the device (atlasjax/ngram_lookup.py) in launches of several verify rounds
(verify_rounds.py, `num_scheduler_steps` > 1): every round's drafts are the host rule's (`speculative.propose`) over
the tokens the request had then, the outputs are plain decoding's, launches are scheduled behind one another, and a
request that ends behind a launch in flight gives everything back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams, ngram_lookup
from atlasjax.speculative import propose
from tests.test_engine import _alone, _assert_idle, _run_staggered, _workload
from tests.test_speculative import ENGINE, LOOP, NGRAM, end_behind_a_pipelined_launch

ROUNDS = 3
PROMPTS = [LOOP, list(range(3, 40)), [5, 9, 5, 9, 5, 9]]


@pytest.fixture(scope="module")
def model_dir(hf_model_factory):
    return hf_model_factory("llama_gqa4")[1]


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def ngram(model_dir):
    return LLM(model_dir, speculative_config=NGRAM, num_scheduler_steps=ROUNDS, **ENGINE)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_the_device_lookup_is_the_host_rule():
    """Random token rows of a small vocabulary (many repeats), every suffix length range and room."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        history = rng.integers(0, rng.integers(2, 6), size=(6, 40)).astype(np.int32)
        last = rng.integers(0, 40, size=6).astype(np.int32)
        k = int(rng.integers(1, 6))
        room = rng.integers(0, k + 1, size=6).astype(np.int32)
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 6))
        drafts, count = (np.asarray(x) for x in ngram_lookup.propose(jnp.asarray(history), jnp.asarray(last),
                                                                     jnp.asarray(room), k, lo, hi))
        for r in range(6):
            want = propose(history[r, :last[r] + 1], int(room[r]), lo, hi) if room[r] else []
            assert drafts[r, :count[r]].tolist() == want
            assert not drafts[r, count[r]:].any()


def _record_rounds(engine):
    """Wrap the engine's verify launches; returns the list each launch appends (its packed batch, output, rounds and
    requests) to, and a function that restores the engine."""
    records, verify, launch = [], engine.runner.verify, engine.launcher._verify

    def run_verify(batch, f, i, prev, plan, rounds=1, prev_emitted=None):
        out = verify(batch, f, i, prev, plan, rounds, prev_emitted)
        records.append([batch, out, rounds])
        return out

    def run_launch(sched, prev):
        n = len(records)
        launched = launch(sched, prev)
        records[n].append(list(sched.decodes))
        return launched
    engine.runner.verify, engine.launcher._verify = run_verify, run_launch

    def restore():
        engine.runner.verify, engine.launcher._verify = verify, launch
    return records, restore


def _check_rounds(records, lo, hi):
    """Each round's drafts (the rows after the request's newest token) are the host's lookup over its tokens up to
    that newest token, and as many as its pages hold are counted. Returns (rounds checked, drafts counted)."""
    checked = counted = 0
    for batch, out, rounds, requests in records:
        if rounds == 1:
            continue
        qs, inputs = batch["query_start"], np.asarray(out.inputs)
        advance, proposed, shift = (np.asarray(x) for x in (out.advance, out.proposed, out.shift))
        for r, req in enumerate(requests):
            tokens = req.prompt_token_ids + req.output_token_ids   # finished: every token it kept
            start, chunk = int(qs[r]), int(qs[r + 1] - qs[r])
            newest = int(batch["seq_lens"][r] + shift[r]) - chunk   # its position in round 0
            budget, cap, emitted = int(batch["budgets"][r] - shift[r]), int(batch["caps"][r]), 0
            for q in range(rounds):
                pos = newest + emitted
                if not advance[q, r] or pos >= len(tokens):
                    break   # it sat this round out (and the rest), or stopped before it
                want = propose(tokens[:pos + 1], min(chunk - 1, budget - emitted - 1), lo, hi)
                assert inputs[q, start + 1:start + 1 + len(want)].tolist() == want
                assert proposed[q, r] == min(len(want), cap - pos - 1)
                checked, counted = checked + 1, counted + int(proposed[q, r])
                emitted += int(advance[q, r])
    return checked, counted


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_outputs_are_plain_decodings_and_every_round_drafts_as_the_host_would(plain, ngram, async_scheduling):
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=30)
    want = _tokens(plain, PROMPTS, params)
    engine = ngram.engine
    engine.async_scheduling = async_scheduling
    records, restore = _record_rounds(engine)
    stats, pipelined = engine.stats.spec, engine.launcher.num_pipelined_verifies
    accepted, drafted = stats.num_accepted_tokens, stats.num_draft_tokens
    try:
        assert _tokens(ngram, PROMPTS, params) == want
    finally:
        restore()
        engine.async_scheduling = True
    assert records and all(rounds == ROUNDS for _, _, rounds, _ in records)   # launches of several rounds ...
    checked, counted = _check_rounds(records, NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"])
    assert checked > len(records)
    assert stats.num_accepted_tokens > accepted                                # ... whose drafts were accepted
    # the metrics count the drafts each lookup found, not the rows reserved for them
    assert stats.num_draft_tokens - drafted == counted
    # scheduled behind one another only when the host's step may run while the device does
    assert (engine.launcher.num_pipelined_verifies > pipelined) == async_scheduling
    _assert_idle(engine)


def test_seeded_sampling_logprobs_and_stops_are_plain_decodings(plain, ngram):
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True,
                             logprobs=3),
              SamplingParams(temperature=0.5, min_p=0.05, seed=4, max_tokens=16, min_tokens=6, logprobs=1)]
    for a, b in zip(plain.generate(PROMPTS[::2], params), ngram.generate(PROMPTS[::2], params)):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        for da, db in zip(a.logprobs, b.logprobs):
            assert da.keys() == db.keys()
            # (GPU float32 matmuls run in TF32, tiled differently for a verify's rows than a decode's)
            np.testing.assert_allclose([v.logprob for v in da.values()], [v.logprob for v in db.values()],
                                       atol=5e-3 if jax.default_backend() == "gpu" else 1e-4)
    free = _tokens(plain, [LOOP], SamplingParams(temperature=0, ignore_eos=True, max_tokens=20))[0]
    stop = next(t for j, t in enumerate(free) if j > 6 and t not in free[:j])   # stops mid-launch, inside drafts
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop])
    a, b = plain.generate([LOOP], params)[0].outputs[0], ngram.generate([LOOP], params)[0].outputs[0]
    assert (b.token_ids, b.finish_reason, b.stop_reason) == (a.token_ids, a.finish_reason, a.stop_reason) == (
        free[:free.index(stop) + 1], "stop", stop)
    _assert_idle(ngram.engine)


def test_a_penalized_request_keeps_its_batch_decoding_plainly(plain, ngram):
    """A request with a penalty keeps per-token state that only decodes advance: no verify launch runs beside it."""
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    engine = ngram.engine
    records, restore = _record_rounds(engine)
    try:
        assert _tokens(ngram, [LOOP, LOOP], params) == _tokens(plain, [LOOP, LOOP], params)
    finally:
        restore()
    assert not records
    _assert_idle(engine)


def test_a_request_aborted_or_stopped_behind_a_pipelined_launch_frees_everything(plain, ngram):
    end_behind_a_pipelined_launch(ngram.engine, plain, PROMPTS[2])


def test_staggered_requests_preemption_and_the_prefix_cache_equal_plain_decoding(model_dir):
    """A preempted request's history is written again by its admit step, and a prompt whose pages come from the
    prefix cache has its history whole too (the drafts follow from it)."""
    work = _workload(n=16, seed=3)
    want = _alone(LLM(model_dir, enable_prefix_caching=False, **ENGINE).engine, work)
    for caching in (False, True):
        engine = LLM(model_dir, speculative_config=NGRAM, num_scheduler_steps=ROUNDS, num_pages=24,
                     enable_prefix_caching=caching, **ENGINE).engine
        records, _ = _record_rounds(engine)
        assert _run_staggered(engine, work) == want
        assert engine.scheduler.num_preemptions > 0 and engine.stats.spec.num_accepted_tokens > 0
        assert _check_rounds(records, NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"])[0] > 0
        _assert_idle(engine)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="tensor parallelism needs two devices (CPU runs offer eight)")
def test_under_tensor_parallelism_the_history_is_whole_on_every_device(hf_model_factory):
    """TP=2: the token history is replicated (the lookup runs outside the sharded model) and the tokens are one
    device's plain decoding's, with launches pipelined."""
    target = hf_model_factory("qwen2_tp")[1]
    prompts = [[7, 8, 9, 10, 7, 8], [5, 9, 5, 9, 5, 9]]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
    want = _tokens(LLM(target, **ENGINE), prompts, params)
    llm = LLM(target, tensor_parallel_size=2, speculative_config=NGRAM, num_scheduler_steps=ROUNDS, **ENGINE)
    history = llm.engine.runner.state.history
    assert history.shape == (ENGINE["max_num_seqs"], ENGINE["max_model_len"])
    assert history.sharding.is_fully_replicated and len(history.sharding.device_set) == 2
    assert _tokens(llm, prompts, params) == want
    assert llm.engine.launcher.num_pipelined_verifies > 0 and llm.engine.stats.spec.num_accepted_tokens > 0
    _assert_idle(llm.engine)

"""Admission: the requests a step admits reset their slots' sampling state (prompt mask, generated counts,
logit bias, bad words and recent generated tokens) in as few admit programs as hold them, with the same state
and outputs as one at a time."""
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.bad_words import HISTORY
from atlasjax.sampling import BIAS_PAD

VOCAB = 512   # the tiny preset's


def _engine(tiny, **kw):
    args = dict(max_num_seqs=32, max_model_len=64, page_size=8, num_pages=300, max_num_batched_tokens=512)
    return LLMEngine(EngineConfig(**{**args, **kw}), loaded=tiny)


def _want(requests, num_slots):
    """What the state must hold after admitting `requests` (slot, tokens, prompt_len, bias, bad words) in
    order, from a state whose every row was dirty: each named slot's rows as its last request sets them."""
    mask = np.ones((num_slots, VOCAB), bool)
    counts = np.full((num_slots, VOCAB), 7, np.int32)
    bias = np.full((num_slots,), -1, np.int32)   # the first bias id, as a witness of the bias rows
    bad = np.full((num_slots,), 5, np.int32)     # the first bad word's last token, likewise
    recent = np.full((num_slots, HISTORY), 5, np.int32)
    for slot, tokens, prompt_len, logit_bias, bad_seqs in requests:
        mask[slot], counts[slot] = False, 0
        for i, t in enumerate(tokens):
            mask[slot, t] = True
            counts[slot, t] += i >= prompt_len
        bias[slot] = next(iter(logit_bias)) if logit_bias else BIAS_PAD
        bad[slot] = bad_seqs[0][-1] if bad_seqs else -1
        generated = tokens[prompt_len:][-HISTORY:]     # the last generated tokens, right-aligned
        recent[slot] = [-1] * (HISTORY - len(generated)) + generated
    return mask, counts, bias, bad, recent


def _dirty(runner):
    import jax.numpy as jnp
    s = runner.state
    runner.state = s.replace(prompt_mask=jnp.ones_like(s.prompt_mask), counts=jnp.full_like(s.counts, 7),
                             bias_ids=jnp.full_like(s.bias_ids, -1), bad_words=jnp.full_like(s.bad_words, 5),
                             recent=jnp.full_like(s.recent, 5))


def _admit_steps(runner, requests):
    """Admit `requests` on a dirty state; returns how many admit programs ran."""
    _dirty(runner)
    ran = []
    run = runner._run

    def counting(spec):
        ran.append(spec.key[0])
        return run(spec)
    runner._run = counting
    try:
        runner.admit(requests)
    finally:
        del runner._run
    return ran.count("admit")


@pytest.fixture(scope="module")
def engine(tiny):
    return _engine(tiny)


def _check_state(runner, requests):
    mask, counts, bias, bad, recent = _want(requests, runner.max_num_seqs)
    np.testing.assert_array_equal(np.asarray(runner.state.prompt_mask), mask)
    np.testing.assert_array_equal(np.asarray(runner.state.counts), counts)
    np.testing.assert_array_equal(np.asarray(runner.state.bias_ids)[:, 0], bias)
    np.testing.assert_array_equal(np.asarray(runner.state.bad_words)[:, 0, -1], bad)
    np.testing.assert_array_equal(np.asarray(runner.state.recent), recent)


def test_a_steps_admissions_run_as_one_program_and_reset_exactly_their_slots(engine, monkeypatch):
    monkeypatch.setattr("atlasjax.admit_steps.ADMIT_TOKENS", 64)   # a program holds 64 tokens: max_model_len's
    rs = np.random.RandomState(0)
    requests = [(slot, rs.randint(0, VOCAB, size=n).tolist(), p, {int(rs.randint(VOCAB)): 1.5} if slot % 2 else None,
                 [[int(rs.randint(VOCAB)), slot]] if slot % 3 else [])
                for slot, n, p in [(3, 10, 10), (0, 40, 25), (17, 1, 1), (9, 12, 6), (30, 5, 2)]]
    assert sum(len(r[1]) for r in requests) > engine.runner.admit_tokens   # two programs: the tokens overflow one
    assert _admit_steps(engine.runner, requests) == 2
    _check_state(engine.runner, requests)
    small = requests[:3]
    assert _admit_steps(engine.runner, small) == 1
    _check_state(engine.runner, small)


def test_short_prompts_share_a_program_past_max_model_len_tokens(engine):
    """16 prompts of max_model_len tokens each (16x what one request may hold) reset their slots in one program."""
    rs = np.random.RandomState(2)
    rows, length = engine.runner.admit_rows, engine.runner.max_model_len
    requests = [(slot, rs.randint(0, VOCAB, size=length).tolist(), length - slot % 3, None, []) for slot in range(rows)]
    assert _admit_steps(engine.runner, requests) == 1
    _check_state(engine.runner, requests)


def test_more_requests_than_one_program_holds_and_a_slot_named_twice(engine):
    rows = engine.runner.admit_rows
    requests = [(slot, [slot % VOCAB, 1], 1, None, []) for slot in range(rows + 3)]
    assert _admit_steps(engine.runner, requests) == 2
    _check_state(engine.runner, requests)
    twice = [(4, [5, 6, 7], 3, None, []), (5, [8], 1, {9: 2.0}, [[3]]), (4, [10, 11, 12, 13], 2, {14: -3.0}, [[1, 2]])]
    assert _admit_steps(engine.runner, twice) == 2          # the later request of slot 4 wins
    _check_state(engine.runner, twice)


def test_requests_admitted_together_sample_as_each_alone(tiny):
    """Penalties and biases read the state admission set: twelve requests admitted in one step, each with
    its own repetition / presence / frequency penalty and bias, equal each request run by itself."""
    rs = np.random.RandomState(1)
    prompts = [rs.randint(0, VOCAB, size=int(n)).tolist() for n in rs.randint(3, 30, size=12)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.0 + 0.2 * (i % 4),
                             presence_penalty=0.5 * (i % 3), frequency_penalty=0.3 * (i % 2),
                             logit_bias={int(rs.randint(VOCAB)): 4.0} if i % 2 else None) for i in range(12)]
    llm = LLM.from_engine(_engine(tiny))
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages

"""The n-gram acceptance gate (atlasjax/ngram_gate.py): where drafts are found but rarely accepted the engine runs
plain launches instead of verify rounds (fewer drafts, the same tokens), tries drafts again after a run of plain
launches, and leaves text whose drafts are accepted alone."""
import dataclasses

import pytest

from atlasjax import LLM, SamplingParams, ngram_gate
from tests.test_engine import _assert_idle
from tests.test_speculative import ENGINE, LOOP, NGRAM

# sampling among 16 tokens: short n-grams recur (drafts found) but what follows them is a coin toss (rarely kept)
FEW = list(range(100, 116))


@dataclasses.dataclass
class _Req:
    accepted_per_round: float | None = None


def test_moving_average_and_batch_mean():
    req = _Req()
    assert ngram_gate.acceptance_pays([req])                  # a new request drafts
    ngram_gate.record_round(req, 0)
    assert ngram_gate.acceptance_pays([req])                  # one round without a kept draft does not close it
    for _ in range(20):
        ngram_gate.record_round(req, 0)
    assert req.accepted_per_round < ngram_gate.MIN_ACCEPTED_PER_ROUND
    assert not ngram_gate.acceptance_pays([req])
    assert ngram_gate.acceptance_pays([req, _Req(4.0)])       # one request accepting much carries the batch
    assert not ngram_gate.acceptance_pays([req] * 7 + [_Req()])
    ngram_gate.record_round(req, 3)
    assert ngram_gate.acceptance_pays([req])                  # a round keeping most drafts opens it again


def test_gate_tries_again_after_a_run_of_plain_launches():
    gate, poor = ngram_gate.Gate(on=True), [_Req(0.0)]
    decisions = [gate.allow(poor) for _ in range(2 * ngram_gate.PROBE_AFTER + 2)]
    probe = ngram_gate.PROBE_AFTER
    assert decisions[:probe] == [False] * probe and decisions[probe]
    assert decisions[probe + 1:2 * probe + 1] == [False] * probe and decisions[2 * probe + 1]
    assert gate.num_gated == 2 * probe
    assert ngram_gate.Gate(on=False).allow(poor)


@pytest.fixture(scope="module")
def model_dir(hf_model_factory):
    return hf_model_factory("llama_gqa4")[1]


def _engines(model_dir, rounds, monkeypatch):
    made = []
    for gate in ("on", "off"):
        monkeypatch.setenv("ATLASJAX_NGRAM_GATE", gate)
        made.append(LLM(model_dir, speculative_config=NGRAM, num_scheduler_steps=rounds, **ENGINE))
    return made


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    _assert_idle(llm.engine)
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats.spec


@pytest.mark.parametrize("rounds", [1, 3])   # host lookups, one round a launch / device lookups
def test_rarely_accepted_drafts_give_way_to_plain_launches(model_dir, rounds, monkeypatch):
    gated, ungated = _engines(model_dir, rounds, monkeypatch)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=48, ignore_eos=True, allowed_token_ids=FEW)
              for s in range(4)]
    prompts = [[FEW[(3 * i + s) % 16] for i in range(12)] for s in range(4)]
    want, free = _run(ungated, prompts, params)
    assert free.num_draft_tokens > 100 and free.num_accepted_tokens < 0.1 * free.num_draft_tokens   # the premise
    got, spec = _run(gated, prompts, params)
    assert got == want
    assert spec.num_draft_tokens < 0.5 * free.num_draft_tokens
    assert gated.engine.scheduler.ngram_gate.num_gated > 0


@pytest.mark.parametrize("rounds", [1, 3])
def test_accepted_drafts_keep_the_gate_open(model_dir, rounds, monkeypatch):
    gated, ungated = _engines(model_dir, rounds, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, free = _run(ungated, [LOOP] * 3, params)
    assert free.num_accepted_tokens > 0.5 * free.num_draft_tokens   # the premise: the random model loops
    got, spec = _run(gated, [LOOP] * 3, params)
    assert got == want
    assert (spec.num_draft_tokens, spec.num_accepted_tokens) == (free.num_draft_tokens, free.num_accepted_tokens)
    assert gated.engine.scheduler.ngram_gate.num_gated == 0

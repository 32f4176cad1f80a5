"""logit_bias through the engine (the embedded SmolLM2 default): a +100 bias forces its token, a -100 bias
bans the greedy choice, a biased request leaves no bias behind in its slot, and several decode iterations
per launch give the same tokens as one."""
from __future__ import annotations

import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.errors import InvalidRequestError

PROMPT = "The capital of France is"
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(default_model_path, **ENGINE)


def _ids(llm, prompts, **kw):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, **kw))]


def test_a_bias_forces_or_bans_tokens_and_leaves_the_slot_clean(llm):
    (base,) = _ids(llm, [PROMPT])
    forced, banned, plain = [o.outputs[0].token_ids for o in llm.generate(
        [PROMPT] * 3, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100}),
                       SamplingParams(temperature=0, max_tokens=6, logit_bias={base[0]: -100}),
                       SamplingParams(temperature=0, max_tokens=6)])]
    assert forced == [42] * 6
    assert banned[0] != base[0]
    assert plain == base                         # a row without bias beside biased ones
    assert _ids(llm, [PROMPT] * 4) == [base] * 4   # every slot, biased before, is clean again


def test_a_sampled_request_follows_its_bias(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True,
                                                logit_bias={7042: 100}))[0].outputs[0]
    assert out.token_ids == [7042] * 5


def test_multi_step_decoding_equals_one_step_with_a_bias(default_model_path):
    kw = dict(logit_bias={11: 5.0, 198: -100}, ignore_eos=True)
    one = _ids(LLM(default_model_path, **ENGINE, num_scheduler_steps=1), [PROMPT, "One, two,"], **kw)
    four = _ids(LLM(default_model_path, **ENGINE, num_scheduler_steps=4), [PROMPT, "One, two,"], **kw)
    assert one == four and all(198 not in ids for ids in one)


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="logit_bias token ids"):
        llm.generate([PROMPT], SamplingParams(logit_bias={10**6: 1}))
    assert _ids(llm, [PROMPT])   # the engine serves on

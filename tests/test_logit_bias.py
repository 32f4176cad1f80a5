"""logit_bias, allowed_token_ids and truncate_prompt_tokens through the engine (the embedded SmolLM2
default): a +100 bias forces its token, a -100 bias bans the greedy choice, an allowed list confines every
token, a biased request leaves nothing behind in its slot, several decode iterations per launch give the
same tokens as one, and a truncated prompt runs as its own last tokens would."""
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


def test_allowed_token_ids_confine_the_output_and_leave_the_slot_free(llm):
    (base,) = _ids(llm, [PROMPT])
    allowed = [base[0] + 1, 13, 2022]                     # the greedy first token is not among them
    confined, sampled = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 2, [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed,
                       logit_bias={13: -100})])]
    assert confined and set(confined) <= set(allowed)
    assert sampled and set(sampled) <= {allowed[0], 2022}
    assert _ids(llm, [PROMPT] * 4) == [base] * 4          # every slot is free again
    with pytest.raises(InvalidRequestError, match="allowed_token_ids token ids"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[10**6]))


def test_a_truncated_prompt_runs_as_its_last_tokens(llm):
    ids = llm.tokenizer.encode("One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve")
    cut = SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=8)
    out, = llm.generate([ids], cut)
    assert out.prompt_token_ids == ids[-8:]
    assert out.outputs[0].token_ids == _ids(llm, [ids[-8:]])[0]
    too_long = ids * 12                                   # past max_model_len=128
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([too_long], SamplingParams(max_tokens=4))
    fitted, = llm.generate([too_long], SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=-1))
    assert fitted.prompt_token_ids == too_long[-124:] and len(fitted.outputs[0].token_ids) <= 4

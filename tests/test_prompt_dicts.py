"""vLLM's prompt dicts in `LLM` (`{"prompt": text}`, `{"prompt_token_ids": ids}`) and their `cache_salt`.

RL and batch code written for vLLM hands `LLM.generate` token-id dicts; they must answer as the plain forms do. A
salt keeps a prompt's cached prefix pages to requests with the same salt (what a user sees:
`num_cached_tokens`), in the engine and in the data-parallel router's prefix routing.
"""
from __future__ import annotations

import pytest

from atlasjax import BeamSearchParams, SamplingParams
from atlasjax.data_parallel import PrefixRouter
from atlasjax.errors import InvalidRequestError
from atlasjax.page_pool import cache_root
from tests.server_util import reference_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return reference_llm(tmp_path_factory)


def test_prompt_dicts_answer_as_text_and_token_ids_do(llm):
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    plain = llm.generate([text, ids], GREEDY)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == text and dicts[1].prompt_token_ids == ids
    one = llm.generate({"prompt_token_ids": ids, "cache_salt": "s"}, GREEDY)      # a single dict is one prompt
    assert len(one) == 1 and one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    beams = llm.beam_search([{"prompt": text}], BeamSearchParams(beam_width=2, max_tokens=3))
    assert beams[0].sequences[0].tokens[:len(ids)] == ids
    vectors = llm.embed([{"prompt": text}, text])
    assert vectors[0].outputs.embedding == vectors[1].outputs.embedding


def test_a_salt_keeps_cached_pages_to_its_own_requests(llm):
    page = llm.engine.config.page_size
    ids = [1000 + i for i in range(3 * page + 5)]      # a prompt no other test sends, over three pages

    def cached(**prompt) -> int:
        return llm.generate({"prompt_token_ids": ids, **prompt}, GREEDY)[0].num_cached_tokens
    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="a") == 3 * page           # its own full pages
    assert cached(cache_salt="b") == 0                  # another salt's: none
    assert cached() == 0                                # the shared cache never saw it
    assert cached() == 3 * page
    assert cached(cache_salt="b") == 3 * page           # b's own, from the first b request
    salted = [[1500 + i for i in range(2 * page + 1)]] * 2
    outs = llm.generate([{"prompt_token_ids": p, "cache_salt": s} for p, s in zip(salted, ("c", "d"))], GREEDY)
    assert [o.outputs[0].token_ids for o in outs][0] == outs[1].outputs[0].token_ids   # same answer either way


def test_bad_prompt_dicts_and_salts_are_refused_naming_what_is_wrong(llm):
    running = len(llm.engine.requests)
    cases = [({"text": "hi"}, "one of 'prompt'"), ({"prompt": "a", "prompt_token_ids": [1]}, "one of 'prompt'"),
             ({"prompt": [1, 2]}, "must be text"), ({"prompt_token_ids": "hi"}, "list of token ids"),
             ({"prompt": "hi", "multi_modal_data": {}}, "multi_modal_data"),
             ({"prompt": "hi", "cache_salt": ""}, "non-empty string"),
             ({"prompt": "hi", "cache_salt": 3}, "non-empty string")]
    for prompt, words in cases:
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate(["fine", prompt], GREEDY)
    assert len(llm.engine.requests) == running          # the good prompt before it was not left queued
    with pytest.raises(InvalidRequestError, match="non-empty string"):
        llm.engine.add_request("x", [1, 2], GREEDY, cache_salt="")


def test_the_data_parallel_router_keys_prefixes_by_salt():
    router = PrefixRouter(2, page_size=4)
    prompt = list(range(100, 112))
    assert cache_root() == 0 and cache_root(cache_salt="a") != cache_root(cache_salt="b")
    assert router.route(prompt, [0, 0], cache_root(cache_salt="a")) == 0
    assert router.route(prompt, [0, 0], cache_root(cache_salt="a")) == 0    # its own prefix: kept together
    # the same tokens under another salt share no cached pages there, so they go by load
    assert router.route(prompt, [1, 0], cache_root(cache_salt="b")) == 1
    assert router.route(prompt, [0, 1], cache_root(cache_salt="b")) == 1

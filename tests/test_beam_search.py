"""Beam search (`LLM.beam_search`, the server's `use_beam_search`): the engine-driven search must find the
sequences a plain search over the model's own logits (`LLM.forward`, recomputed from scratch each round)
finds, with their scores; width 1 must be greedy decoding; end tokens complete beams and the length
penalty ranks them as vLLM's score says; both OpenAI routes must answer what `LLM.beam_search` does."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from atlasjax import BeamSearchParams, SamplingParams
from atlasjax.beam_search import BeamSearch
from atlasjax.errors import InvalidRequestError
from atlasjax.outputs import Logprob
from tests.server_util import API_KEY, MODEL_NAME, main_server, reference_llm

PROMPTS = ["The sky is", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return reference_llm(tmp_path_factory)


def _reference(llm, prompt_ids, width, max_tokens, length_penalty=1.0):
    """Beam search by hand over full forward passes: (generated ids, cumulative logprob), best first."""
    def score(tokens, cum):
        return cum / len(tokens) ** length_penalty
    beams = [(list(prompt_ids), 0.0)]
    for _ in range(max_tokens):
        logits = llm.forward([tokens for tokens, _ in beams])
        grown = []
        for (tokens, cum), row in zip(beams, logits):
            last = row[-1].astype(np.float64)
            logprobs = last - last.max() - np.log(np.exp(last - last.max()).sum())
            for t in np.argsort(-logprobs)[:2 * width]:
                grown.append((tokens + [int(t)], cum + float(logprobs[t])))
        beams = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
    return [(tokens[len(prompt_ids):], cum) for tokens, cum in beams]


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_finds_what_a_search_over_the_models_logits_finds(llm, length_penalty):
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt)
        want = _reference(llm, ids, 3, 5, length_penalty)
        got = [(seq.output_token_ids, seq.cum_logprob) for seq in out.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        np.testing.assert_allclose([c for _, c in got], [c for _, c in want], rtol=1e-4, atol=1e-4)
        for seq in out.sequences:
            assert seq.tokens[:len(ids)] == ids and seq.finish_reason == "length"
            assert seq.text == llm.tokenizer.decode(seq.output_token_ids)
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages    # every round's pages came back


def test_width_one_is_greedy_decoding(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    (seq,) = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=1, max_tokens=6))[0].sequences
    assert seq.output_token_ids == greedy.token_ids


def _entry(logprobs: dict[int, float]) -> dict[int, Logprob]:
    return {t: Logprob(lp) for t, lp in logprobs.items()}


def test_end_tokens_complete_beams_and_the_length_penalty_ranks_them():
    eos = 9
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3), [eos], max_model_len=16)
    search.advance([_entry({eos: -0.1, 5: -0.5, 6: -3.0, 7: -4.0})])
    assert [b.tokens for b in search.completed] == [[1, 2, eos]]            # ended: out of the live beams
    assert [b.tokens for b in search.beams] == [[1, 2, 5], [1, 2, 6]]
    search.advance([_entry({5: -0.1, 6: -0.2, 7: -5, 8: -6}), _entry({5: -0.1, 6: -0.3, 7: -5, 8: -6})])
    search.advance([_entry({5: -0.1, 6: -0.2, 7: -5, 8: -6})] * 2)
    assert search.done
    best = search.output().sequences
    # vLLM's score: cumulative logprob / (tokens, not counting the end token) ** length_penalty
    assert best[0].tokens == [1, 2, eos] and best[0].finish_reason == "stop" and best[0].stop_reason == eos
    assert best[0].cum_logprob == pytest.approx(-0.1)
    assert best[1].tokens == [1, 2, 5, 5, 5] and best[1].finish_reason == "length"
    # with ignore_eos the end token is one more candidate
    free = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True), [eos], 16)
    free.advance([_entry({eos: -0.1, 5: -0.5})])
    assert not free.completed and [b.tokens[-1] for b in free.beams] == [eos, 5]


@pytest.mark.parametrize("kwargs, match", [(dict(beam_width=0, max_tokens=4), "beam_width"),
                                           (dict(beam_width=11, max_tokens=4), "at most 10"),
                                           (dict(beam_width=2, max_tokens=0), "max_tokens"),
                                           (dict(beam_width=2, max_tokens=4, length_penalty="x"), "length_penalty")])
def test_bad_params_are_refused(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        BeamSearchParams(**kwargs)


def test_an_over_long_request_is_refused_before_any_round(llm):
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=llm.engine.max_model_len))
    assert not llm.engine.has_unfinished()


# ---- the server's use_beam_search


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return main_server(request, tmp_path_factory)


def _post(server, path, body):
    return httpx.post(server.url + path, json={"model": MODEL_NAME, **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_use_beam_search_on_both_routes_answers_what_llm_beam_search_does(server, llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    want = llm.beam_search(PROMPTS, params)
    r = _post(server, "/v1/completions", {"prompt": PROMPTS, "n": 2, "max_tokens": 4, "use_beam_search": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == [s.text for out in want for s in out.sequences]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 16
    messages = [{"role": "user", "content": "Name three colors."}]
    want_chat = llm.beam_search(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True), add_special_tokens=False), params)[0]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "n": 2, "max_tokens": 4, "use_beam_search": True})
    assert [c["message"]["content"] for c in r.json()["choices"]] == [s.text for s in want_chat.sequences]


@pytest.mark.parametrize("extra, param", [({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"),
                                          ({"n": 11}, "n"), ({"stop": ["x"]}, "stop")])
def test_what_beam_search_cannot_do_is_a_400(server, extra, param):
    r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "use_beam_search": True, "n": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param

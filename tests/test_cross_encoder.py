"""Cross-encoders (atlasjax/cross_encoder.py): a causal LM read as a reranker through vLLM's `hf_overrides`
(Qwen3-Reranker's recipe: the "yes" and "no" rows of the LM head as a one-label head). LLM.score, /score and
/rerank score each pair as transformers' causal LM does: softmax over the two tokens' logits at the pair's last
position. The tiny Llama 3 of the server tests (a real tokenizer with "yes" and "no" tokens)."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from atlasjax import LLM
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError
from tests.server_util import MODEL_NAME, tiny_model_dir

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}
KW = dict(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64)
QUERY = "<Instruct>: Given a question, find the passage that answers it\n<Query>: what is the capital of France?\n"
DOCS = ["<Document>: Paris is the capital of France.", "<Document>: Bananas are yellow.",
        "<Document>: France borders Spain."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def reranker(model_dir):
    return LLM(model_dir, hf_overrides=RERANKER, **KW)


def _reference_scores(model_dir, tokenizer, query, docs, tokens=("no", "yes")):
    """transformers' causal LM: softmax over the tokens' logits at each pair's last position."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = [tokenizer.encode(t, add_special_tokens=False)[0] for t in tokens]
    out = []
    for doc in docs:
        pair = tokenizer.encode(query) + tokenizer.encode(doc, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([pair])).logits[0, -1]
        out.append(torch.softmax(logits[ids], 0).numpy())
    return np.array(out)


def test_scores_equal_the_causal_lms_yes_probability(model_dir, reranker):
    assert reranker.engine.pooling_only and reranker.engine.classifier_labels == ("score",)
    got = [o.outputs.score for o in reranker.score(QUERY, DOCS)]
    want = _reference_scores(model_dir, reranker.engine.tokenizer, QUERY, DOCS)[:, 1]
    np.testing.assert_allclose(got, want, atol=1e-5)
    pairwise = [o.outputs.score for o in reranker.score([QUERY] * 3, DOCS)]      # N -> N: the same pairs
    np.testing.assert_allclose(pairwise, got, atol=1e-6)


def test_tokens_as_labels_classify_as_their_softmax(model_dir):
    llm = LLM(model_dir, hf_overrides={"classifier_from_token": ["no", "yes", "maybe"]}, **KW)
    assert llm.engine.classifier_labels == ("no", "yes", "maybe")
    tok = llm.engine.tokenizer
    probs = [o.outputs.probs for o in llm.classify([QUERY + d for d in DOCS])]
    want = _reference_scores(model_dir, tok, "", [QUERY + d for d in DOCS], ("no", "yes", "maybe"))
    np.testing.assert_allclose(probs, want, atol=1e-5)


@pytest.mark.parametrize("overrides, words", [
    ({"classifier_from_token": ["no", "yes"], "num_labels": 2}, "not supported"),
    ({"architectures": ["Qwen3ForSequenceClassification"]}, "needs classifier_from_token"),
    ({"classifier_from_token": "yes"}, "non-empty list"),
    ({"classifier_from_token": ["no", "yes", "maybe"], "is_original_qwen3_reranker": True}, "exactly two"),
    ({"classifier_from_token": ["no", "yes"], "method": "bogus"}, "not supported"),
    ({"classifier_from_token": ["no"], "architectures": ["Qwen3ForCausalLM"]}, "ForSequenceClassification"),
    ("{oops", "not valid JSON")])
def test_bad_overrides_are_refused_by_name(overrides, words):
    with pytest.raises(EngineConfigError, match=words):
        EngineConfig(hf_overrides=overrides)


def test_a_token_that_is_not_one_token_is_refused(model_dir):
    with pytest.raises(EngineConfigError, match="exactly one"):
        LLM(model_dir, hf_overrides={"classifier_from_token": ["no", " definitely-not-one-token"],
                                     "method": "from_2_way_softmax"}, **KW)


def test_served_rerank_and_score_rank_by_the_pair_scores(model_dir, reranker):
    from atlasjax.async_llm import AsyncLLM
    from serving.app import create_app
    want = [o.outputs.score for o in reranker.score(QUERY, DOCS)]
    engine = AsyncLLM(model_dir, hf_overrides=RERANKER, **KW)
    app = create_app(engine, served_model_name=MODEL_NAME)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            rerank = await client.post("/rerank", json={"model": MODEL_NAME, "query": QUERY, "documents": DOCS,
                                                        "top_n": 2})
            score = await client.post("/v1/score", json={"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCS})
            chat = await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2,
                                                                   "messages": [{"role": "user", "content": "hi"}]})
            return rerank, score, chat
    try:
        rerank, score, chat = asyncio.run(go())
    finally:
        engine.shutdown(drain=False)
    assert rerank.status_code == 200 and score.status_code == 200
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in rerank.json()["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in rerank.json()["results"]], [want[i] for i in order],
                               atol=1e-6)
    np.testing.assert_allclose([d["score"] for d in score.json()["data"]], want, atol=1e-6)
    assert chat.status_code == 400          # a reranker serves scores only (runner auto: pooling)

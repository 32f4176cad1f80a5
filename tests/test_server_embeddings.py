"""/v1/embeddings (OpenAI's) and /v1/score (vLLM's) through the official `openai` SDK and httpx against a live
server: the vectors must equal `LLM.embed` on the same model and inputs, in every input form the API takes
(text, texts, token ids, chat messages), as floats and as base64; `dimensions`, vLLM's
`truncate_prompt_tokens` and `normalize` must change them as in-process; bad requests get a 400 naming
the field, and the server keeps serving."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from atlasjax import PoolingParams
from tests.server_util import API_KEY, MODEL_NAME, main_server, metric_value, reference_llm, shared_server

TEXTS = ["The capital of France is Paris.", "A cat sat on the mat.", "Embeddings pool hidden states."]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return main_server(request, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return reference_llm(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def _ref(llm, inputs, params=None):
    return [np.array(o.outputs.embedding) for o in llm.embed(inputs, params)]


def test_texts_and_token_ids_embed_as_in_process(client, llm):
    want = _ref(llm, TEXTS)
    r = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL_NAME
    for d, w in zip(r.data, want):
        np.testing.assert_allclose(d.embedding, w, atol=1e-5)
        assert np.linalg.norm(d.embedding) == pytest.approx(1.0, abs=1e-5)
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(t) for t in ids)
    one = client.embeddings.create(model=MODEL_NAME, input=ids[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, want[1], atol=1e-5)
    # the SDK's default asks for base64 and decodes it to floats
    b64 = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0])
    np.testing.assert_allclose(b64.data[0].embedding, want[0], atol=1e-6)


def test_dimensions_truncation_and_normalize(client, http, llm):
    r = client.embeddings.create(model=MODEL_NAME, input=TEXTS[2], dimensions=8, encoding_format="float")
    np.testing.assert_allclose(r.data[0].embedding, _ref(llm, [TEXTS[2]], PoolingParams(dimensions=8))[0], atol=1e-5)
    assert len(r.data[0].embedding) == 8
    body = http.post("/v1/embeddings", json={"input": TEXTS[0], "truncate_prompt_tokens": 3, "normalize": False}).json()
    want = _ref(llm, [TEXTS[0]], PoolingParams(truncate_prompt_tokens=3, normalize=False))[0]
    np.testing.assert_allclose(body["data"][0]["embedding"], want, atol=1e-4)
    assert body["usage"]["prompt_tokens"] == 3 and body["object"] == "list" and body["id"].startswith("embd-")


def test_chat_messages_embed_their_rendered_template(http, llm):
    messages = [{"role": "user", "content": "Where is Paris?"}]
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=False),
                               add_special_tokens=False)
    body = http.post("/v1/embeddings", json={"model": MODEL_NAME, "messages": messages}).json()
    np.testing.assert_allclose(body["data"][0]["embedding"], _ref(llm, [ids])[0], atol=1e-5)
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_score_is_the_cosine_of_the_two_embeddings(http, llm):
    a, b, c = _ref(llm, TEXTS)
    body = http.post("/v1/score", json={"model": MODEL_NAME, "text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx([a @ b, a @ c], abs=1e-5)
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "score"
    pairs = http.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([a @ b, b @ c], abs=1e-5)


def test_rerank_orders_documents_by_similarity_to_the_query(http, llm):
    query, docs = TEXTS[0], TEXTS[1:] + ["Paris is the capital of France."]
    q, *d = _ref(llm, [query, *docs])
    want = sorted(range(len(docs)), key=lambda i: -(q @ d[i]))
    body = http.post("/v1/rerank", json={"model": MODEL_NAME, "query": query, "documents": docs, "top_n": 2}).json()
    assert [r["index"] for r in body["results"]] == want[:2]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([q @ d[i] for i in want[:2]], abs=1e-5)
    assert body["results"][0]["document"]["text"] == docs[want[0]] and body["usage"]["total_tokens"] > 0
    plain = http.post("/rerank", json={"query": query, "documents": [{"text": t} for t in docs],
                                       "return_documents": False}).json()
    assert [r["index"] for r in plain["results"]] == want and "document" not in plain["results"][0]
    for bad, param in (({"query": "", "documents": docs}, "query"), ({"query": "q", "documents": []}, "documents"),
                       ({"query": "q", "documents": [1]}, "documents")):
        r = http.post("/v2/rerank", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], "text"]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "normalize": "yes"}, "normalize"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": [[1, 10**7]]}, "input"),
])
def test_bad_embedding_requests_get_a_400_naming_the_field(http, body, param):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_too_long_or_too_many_dimensions_is_refused_and_the_server_serves_on(http, llm):
    r = http.post("/v1/embeddings", json={"input": list(range(1, 300))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/embeddings", json={"input": "x", "dimensions": 100_000})
    assert r.status_code == 400 and "embedding size" in r.json()["error"]["message"]
    r = http.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"
    r = http.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1], "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    ok = http.post("/v1/embeddings", json={"input": list(range(1, 300)), "truncate_prompt_tokens": -1}).json()
    assert ok["usage"]["prompt_tokens"] == llm.engine.max_model_len
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["kv_pages_free"] == health["kv_pages_total"]


def test_metrics_count_embedded_inputs_and_tokens(http):
    before = http.get("/metrics").text
    ids = [[5, 6, 7], [8, 9]]
    assert http.post("/v1/embeddings", json={"input": ids}).status_code == 200
    after = http.get("/metrics").text
    for name, grew in (("atlasjax_embedding_inputs_total", 2), ("atlasjax_embedding_tokens_total", 5),
                       ("atlasjax_embedding_request_latency_seconds_count", 1)):
        assert metric_value(after, name) - metric_value(before, name) == grew, name


def test_a_pooling_server_embeds_and_refuses_generation(request, tmp_path_factory, llm):
    """`serve --runner pooling`: embeddings as the generate server's; chat and completions get a 400."""
    server = shared_server(request, tmp_path_factory, "pooling", "--runner", "pooling")
    with httpx.Client(base_url=server.url, timeout=120) as http:
        body = http.post("/v1/embeddings", json={"input": TEXTS[:2]}).json()
        for d, w in zip(body["data"], _ref(llm, TEXTS[:2])):
            np.testing.assert_allclose(d["embedding"], w, atol=1e-5)
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 400 and "embeddings only" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert r.status_code == 400 and "embeddings only" in r.text
        assert http.get("/health").json()["status"] == "ok"

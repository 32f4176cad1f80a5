"""vLLM's extensions to the OpenAI API through the official `openai` SDK against the shared live server:
allowed_token_ids, truncate_prompt_tokens, continuous_usage_stats, return_tokens_as_token_ids (per request
and as the serve flag's default), prompt_logprobs, continue_final_message / add_generation_prompt, and
X-Request-Id. Greedy references come from `LLM` in this process, as in test_server_openai.py."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.server_util import (API_KEY, CHAT, MODEL_NAME, chat_reference, greedy_reference, main_server,
                               reference_llm)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return main_server(request, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return reference_llm(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_allowed_token_ids_and_truncate_prompt_tokens_as_vllm_takes_them(client, llm):
    """vLLM's extra fields: allowed_token_ids confines the answer; truncate_prompt_tokens runs the prompt's last
    k tokens, which usage counts and echo shows."""
    allowed = [llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no")]
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                       extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert r.choices[0].message.content.replace(" yes", "").replace(" no", "") == ""
    text = "One, two, three, four, five, six, seven, eight, nine, ten"
    ids = llm.tokenizer.encode(text)
    r = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=4, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 6})
    assert r.usage.prompt_tokens == 6
    (want,) = greedy_reference(llm, [ids[-6:]], 4)
    assert r.choices[0].text == llm.tokenizer.decode(ids[-6:]) + want.outputs[0].text
    fitted = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi " * 2000}],
                                            max_tokens=3, extra_body={"truncate_prompt_tokens": -1})
    assert fitted.usage.prompt_tokens + 3 == llm.engine.max_model_len


def test_continuous_usage_stats_count_tokens_so_far_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage up to it."""
    for create, kwargs in ((client.chat.completions.create, {"messages": CHAT}),
                           (client.completions.create, {"prompt": ["Hello world", "Numbers: one two"]})):
        chunks = list(create(model=MODEL_NAME, max_tokens=6, temperature=0, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}, **kwargs))
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
        assert counts == sorted(counts) and counts[-1] == (6 if "messages" in kwargs else 12)
        assert max(counts[:-1]) == counts[-1]        # the last content chunk already counts every token


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(client, llm):
    """vLLM's return_tokens_as_token_ids: chat and legacy logprobs (echoed prompt included, streamed or not)
    name each token `token_id:N`, N the id the model chose or was given."""
    ref = chat_reference(llm, CHAT, 4).outputs[0]
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in ref.token_ids]
    assert all(t.token.startswith("token_id:") for e in content for t in e.top_logprobs)
    prompt = "The quick brown fox"
    ids = llm.tokenizer.encode(prompt)
    (want,) = greedy_reference(llm, [prompt], 3)
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True,
                  extra_body={"return_tokens_as_token_ids": True})
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids + want.outputs[0].token_ids]
    streamed = [t for c in client.completions.create(stream=True, **kwargs) for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    plain = client.completions.create(**{**kwargs, "extra_body": {}}).choices[0].logprobs
    assert not any(t.startswith("token_id:") for t in plain.tokens)


def test_completion_vllm_prompt_logprobs(server, llm):
    """vLLM's `prompt_logprobs` field: each choice gets the prompt's logprobs in vLLM's shape (null for the
    first token, then {token id: {logprob, rank, decoded_token}} with the token and the top k), in the
    response or in a stream's first chunk of that choice."""
    from atlasjax import SamplingParams
    prompt = "The quick brown fox"
    ids = llm.tokenizer.encode(prompt)
    ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3))[0]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 3}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=120).json()
    got = r["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for token, entry, want in zip(ids[1:], got[1:], ref.prompt_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(want[token].logprob, abs=1e-4)
        assert 3 <= len(entry) <= 4 and {e["rank"] for e in entry.values()} >= {1, 2, 3}
    assert "logprobs" not in r["choices"][0] or r["choices"][0]["logprobs"] is None   # not asked for

    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    firsts = [e["choices"][0]["prompt_logprobs"] for e in events if "prompt_logprobs" in e["choices"][0]]
    assert firsts == [got]


def test_chat_vllm_prompt_logprobs(server, llm):
    """vLLM's `prompt_logprobs` on a chat completion: the rendered prompt's logprobs beside the choices (not in a
    stream: a 400, as vLLM answers)."""
    from atlasjax import SamplingParams
    ref = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    got = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120).json()
    entries = got["prompt_logprobs"]
    assert len(entries) == len(ref.prompt_token_ids) and entries[0] is None
    for token, entry, want in zip(ref.prompt_token_ids[1:], entries[1:], ref.prompt_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(want[token].logprob, abs=1e-4)
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_chat_continues_a_final_assistant_message(server, client, llm):
    # vLLM's continue_final_message / add_generation_prompt fields; /tokenize renders the same
    from atlasjax import SamplingParams
    messages = CHAT + [{"role": "assistant", "content": "Red, green"}]
    ref = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5), continue_final_message=True)[0]
    assert llm.tokenizer.decode(ref.prompt_token_ids, skip_special_tokens=False).endswith("Red, green")
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(server.url + "/tokenize", headers=headers, json={
        "messages": messages, "continue_final_message": True}).json()["tokens"]
    assert tokens == ref.prompt_token_ids
    # add_generation_prompt reaches the template (this one, Llama 3's first, always opens the next turn)
    closed = httpx.post(server.url + "/tokenize", headers=headers, json={
        "messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    tok = llm.tokenizer
    assert closed == tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=False), add_special_tokens=False)
    for body in ({"continue_final_message": True, "add_generation_prompt": True, "messages": messages},
                 {"continue_final_message": True, "messages": CHAT}):
        bad = httpx.post(server.url + "/v1/chat/completions", headers=headers,
                         json={"model": MODEL_NAME, "max_tokens": 2, **body})
        assert bad.status_code == 400, bad.text


def test_serve_flag_sets_the_token_id_default_a_request_overrides():
    """`serve --return-tokens-as-token-ids` makes `token_id:N` the default; a request's own field wins."""
    import argparse

    from serving.cli import add_server_args
    from serving.protocol import Fields
    from serving.state import ServerState
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    flag = parser.parse_args(["--return-tokens-as-token-ids"]).return_tokens_as_token_ids
    assert flag and not parser.parse_args([]).return_tokens_as_token_ids
    state = ServerState(llm=None, model_name=MODEL_NAME, metrics=None, return_tokens_as_token_ids=flag)
    assert state.tokens_as_ids(Fields({}))
    assert not state.tokens_as_ids(Fields({"return_tokens_as_token_ids": False}))


def test_x_request_id_names_the_response_and_comes_back(server):
    """vLLM's X-Request-Id: the client's id comes back as a header and names the response (`chatcmpl-<id>`),
    even for two requests sent at once with the same id; without one (or with an unusable one) the
    server makes one up."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 3, "temperature": 0}

    async def both():
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-7"})
                                          for _ in range(2)))
    for r in asyncio.run(both()):
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7"
        assert r.json()["id"] == "chatcmpl-trace-7"
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
                   headers={**headers, "X-Request-Id": "has space"}, timeout=120)
    made_up = r.headers["x-request-id"]
    assert r.status_code == 200 and made_up != "has space" and len(made_up) == 32
    assert httpx.get(server.url + "/health").headers["x-request-id"]


def test_reset_prefix_cache_makes_the_next_request_compute_its_prompt(server, client):
    """vLLM's POST /reset_prefix_cache: a prompt cached by the request before is computed again after it."""
    messages = [{"role": "user", "content": "Cache me: " + "alpha beta gamma " * 12}]

    def cached():
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
        return r.usage.prompt_tokens_details.cached_tokens
    cached()
    assert cached() > 0
    r = httpx.post(server.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
    assert cached() == 0
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 401      # the key guards it


def test_cache_salt_keeps_prefix_cache_pages_to_requests_of_the_same_salt(client):
    """vLLM's `cache_salt`: a prompt reuses cached pages only from requests that sent the same salt, on the
    completion, chat and Responses routes; an empty or non-string salt is refused naming the field."""
    import uuid
    messages = [{"role": "user", "content": f"{uuid.uuid4()} " + "salted words " * 20}]

    def cached(**extra):
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0         # the same salt: its pages
    assert cached(cache_salt="tenant-b") == 0        # another salt: none of them
    assert cached() == 0                             # no salt: the shared cache, which never saw it
    assert cached() > 0
    prompt = f"{uuid.uuid4()} " + "more salted words " * 20
    done = [client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body={"cache_salt": s})
            for s in ("x", "y", "x")]
    assert [r.usage.prompt_tokens_details.cached_tokens > 0 for r in done] == [False, False, True]
    responses = [client.responses.create(model=MODEL_NAME, input=prompt, max_output_tokens=2,
                                         extra_body={"cache_salt": "z"}) for _ in range(2)]
    assert [r.usage.input_tokens_details.cached_tokens > 0 for r in responses] == [False, True]
    for bad in ("", 7):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                           extra_body={"cache_salt": bad})
        assert e.value.body["param"] == "cache_salt" and "non-empty string" in e.value.body["message"]


def test_invocations_answers_each_task_as_its_own_route(server, client):
    """SageMaker's POST /invocations (vLLM's): the body's fields pick the route, and the answer is that route's."""
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def post(path, body):
        return httpx.post(server.url + path, json=body, headers=headers, timeout=120)
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    completion = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    for body, path in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        via, direct = post("/invocations", body).json(), post(path, body).json()
        assert via["object"] == direct["object"] and via["choices"] == direct["choices"]
    vectors = post("/invocations", {"model": MODEL_NAME, "input": ["a", "b"]}).json()
    assert vectors["object"] == "list" and len(vectors["data"]) == 2
    ranked = post("/invocations", {"model": MODEL_NAME, "query": "a", "documents": ["a", "b c"]}).json()
    assert len(ranked["results"]) == 2
    bad = post("/invocations", {"model": MODEL_NAME, "text": "?"})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    refused = post("/invocations", {**chat, "max_tokens": -1})       # the route's own checks and error
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert httpx.post(server.url + "/invocations", json=chat).status_code == 401      # the key guards it


def test_several_served_model_names_are_each_accepted_and_listed():
    """vLLM's `--served-model-name a b`: /v1/models lists both, a request may name either (its response
    says which), the first is the default, and another name is refused naming the served ones."""
    from serving.app import create_app
    from tests.test_reasoning import ScriptedLLM
    app = create_app(ScriptedLLM(["Hi", "!"]), served_model_name=["main-name", "alias"])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            models = (await c.get("/v1/models")).json()["data"]
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            answers = [await c.post("/v1/chat/completions", json={**body, **extra})
                       for extra in ({"model": "alias"}, {}, {"model": "other"})]
            return models, answers, await c.get("/v1/models/alias")
    models, (alias, default, other), card = asyncio.run(go())
    assert [m["id"] for m in models] == ["main-name", "alias"] and card.json()["root"] == "main-name"
    assert alias.json()["model"] == "alias" and default.json()["model"] == "main-name"
    assert other.status_code == 400 and "'main-name', 'alias'" in other.json()["error"]["message"]
    import argparse

    from serving.cli import add_server_args
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert parser.parse_args(["--served-model-name", "main-name", "alias"]).served_model_name == ["main-name", "alias"]


def test_bad_words_keep_a_word_out_of_the_answer(client, llm):
    """vLLM's bad_words: the greedy answer's first word, banned, is not its first token any more."""
    ref = chat_reference(llm, CHAT, 4).outputs[0]
    word = llm.tokenizer.decode(ref.token_ids[:1]).strip()
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, extra_body={"bad_words": [word]})
    first = r.choices[0].logprobs.content[0].token
    assert first.strip() != word and r.choices[0].message.content != ref.text
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, extra_body={"bad_words": "x"})

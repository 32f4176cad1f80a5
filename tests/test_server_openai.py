"""The OpenAI-compatible API through the official `openai` SDK against a live server.

Greedy outputs must equal `LLM.generate` / `LLM.chat` on the same model (computed in this
process); usage must match the tokenizer; streaming must equal non-streaming; 32 concurrent
streams must each get their own output; a client that drops mid-stream must give its pages back.
"""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from tests.server_util import (API_KEY, CHAT, MODEL_NAME, chat_reference, greedy_reference, main_server,
                               metric_value, reference_llm, shared_server)



@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return main_server(request, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return reference_llm(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_chat_greedy_equals_llm_with_usage(client, llm):
    ref = chat_reference(llm, CHAT, 10)
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids) == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_chat_stream_equals_llm_with_usage(client, llm):
    ref = chat_reference(llm, CHAT, 10)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_completion_prompt_forms_equal_llm(client, llm):
    prompts = ["The quick brown fox", "Once upon a time"]
    refs = greedy_reference(llm, prompts, 8)
    ids = list(refs[1].prompt_token_ids)
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in refs]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    assert r.usage.completion_tokens == 16
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == refs[1].outputs[0].text and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=8, temperature=0, echo=True)
    assert [c.text for c in r.choices] == [prompts[1] + refs[1].outputs[0].text] * 2


def test_completion_stream_multiple_prompts_with_usage(client, llm):
    prompts = ["Hello world", "Numbers: one two"]
    refs = greedy_reference(llm, prompts, 6)
    texts = {0: "", 1: ""}
    finishes, usage = {}, None
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {i: o.outputs[0].text for i, o in enumerate(refs)}
    assert finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12 and usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)


def test_stop_string_cuts_text(client, llm):
    full = chat_reference(llm, CHAT, 16).outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                            stop=stop, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client, llm):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: 0 for a prompt never seen, then the full pages
    the prefix cache holds when the same prompt comes again (whole or streamed, chat or completion)."""
    import uuid
    text = f"{uuid.uuid4()} " + " ".join(f"word{i}" for i in range(60))     # a prompt no other test sends
    page = llm.engine.config.page_size
    first = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=[text, text + " more"], max_tokens=2, temperature=0)
    n_prompt = first.usage.prompt_tokens
    assert n_prompt > 2 * page and first.usage.prompt_tokens_details.cached_tokens == 0
    n_longer = again.usage.prompt_tokens - n_prompt
    # at least one token of each prompt is always computed; the longer prompt reuses the first one's
    # full pages, which may cover every token the shorter one had
    expected = (n_prompt - 1) // page * page + min((n_longer - 1) // page, n_prompt // page) * page
    assert again.usage.prompt_tokens_details.cached_tokens == expected
    messages = [{"role": "user", "content": text}]
    chat = [client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0)
            for _ in range(2)]
    streamed = [c for c in client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}) if c.usage][0]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (*chat, streamed)]
    assert cached[0] == 0 and cached[1] == cached[2] == (chat[0].usage.prompt_tokens - 1) // page * page > 0


def test_n2_sampled_choices_and_usage(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, n=2, temperature=1.0,
                                       seed=7, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    again = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, n=2, temperature=1.0,
                                           seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded


def test_chat_logprobs_match_llm(client, llm):
    ref = chat_reference(llm, CHAT, 5, logprobs=3).outputs[0]
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry, token_id, ref_lp in zip(content, ref.token_ids, ref.logprobs):
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(ref_lp[token_id].logprob, abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token    # greedy picks the most likely token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_completion_legacy_logprobs_with_echo(client, llm):
    """echo + logprobs scores the prompt too (what evaluation harnesses read): each prompt token but the
    first gets the logprob the model gives it, as `LLM.generate(prompt_logprobs=)` computes, streamed
    or not."""
    from atlasjax import SamplingParams
    prompt = "The quick brown fox"
    ids = llm.tokenizer.encode(prompt)
    num_prompt = len(ids)
    ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2))[0]
    want = [None] + [entry[t].logprob for t, entry in zip(ids[1:], ref.prompt_logprobs[1:])]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                  echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:num_prompt] == pytest.approx(want[1:], abs=1e-4)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])          # top 2, plus the token if not in them
    assert all(isinstance(x, float) for x in lp.token_logprobs[num_prompt:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.choices[0].text.startswith(prompt)
    assert r.choices[0].text == prompt + ref.outputs[0].text

    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                            logprobs=2, echo=True, stream=True))
    streamed = [x for c in chunks for x in (c.choices[0].logprobs.token_logprobs if c.choices else [])]
    assert streamed == lp.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_echoed_prompt_logprobs_for_several_prompts_and_choices(client):
    """Two prompts, two choices each: every choice echoes its own prompt with that prompt's logprobs,
    streamed or not."""
    prompts = ["The quick brown fox", "Once upon a time there"]
    kwargs = dict(model=MODEL_NAME, prompt=prompts, max_tokens=3, temperature=0, logprobs=1, echo=True, n=2)
    r = client.completions.create(**kwargs)
    by_index = {c.index: c for c in r.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    for index, choice in by_index.items():
        assert choice.text.startswith(prompts[index // 2])
        assert choice.logprobs.token_logprobs[0] is None
        assert all(isinstance(x, float) for x in choice.logprobs.token_logprobs[1:])
    assert by_index[0].logprobs.token_logprobs == by_index[1].logprobs.token_logprobs   # greedy: alike
    streamed: dict[int, list] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert streamed == {i: c.logprobs.token_logprobs for i, c in by_index.items()}


def test_32_concurrent_streams_get_their_own_outputs(server, llm):
    prompts = [f"Client {i} asks about topic {i * 7 % 13}" for i in range(32)]
    refs = greedy_reference(llm, prompts, 8)
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=180)

    async def one(prompt):
        text, finish = "", None
        stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run_all():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()
    results = asyncio.run(run_all())
    assert [text for text, _ in results] == [o.outputs[0].text for o in refs]
    assert all(finish == "length" for _, finish in results)
    assert len({text for text, _ in results}) > 1


def wait_pages_back_to_idle(url: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        free, total = metric_value(metrics, "atlasjax_kv_pages_free"), metric_value(metrics, "atlasjax_kv_pages_total")
        if free == total and metric_value(metrics, "atlasjax_num_requests_running") == 0:
            return
        assert time.monotonic() < deadline, f"pages not freed after the client left: {free}/{total}"
        time.sleep(0.1)


def generated_tokens(url: str) -> float:
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return metric_value(metrics, "atlasjax_generation_tokens_total")


def aborted_sequences(url: str) -> float:
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    series = 'atlasjax_requests_finished_total{finished_reason="abort"} '
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(series))


def test_client_disconnect_aborts_and_frees_pages(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before, aborted_before = generated_tokens(server.url), aborted_sequences(server.url)
    idle = httpx.get(server.url + "/health").json()
    assert idle["kv_pages_free"] == idle["kv_pages_total"]
    body = {"model": MODEL_NAME, "prompt": "Keep talking", "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        events = r.iter_lines()
        assert [line for line, _ in zip(events, range(6)) if line.startswith("data: ")]
        busy = httpx.get(server.url + "/health").json()
        assert busy["num_running"] == 1 and busy["kv_pages_free"] < busy["kv_pages_total"]
    wait_pages_back_to_idle(server.url)
    # Non-streaming: the client gives up (read timeout) while the server is still generating
    # (240 tokens take the tiny CPU model well over the 0.5 s the client waits).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, headers=headers, timeout=0.5)
    wait_pages_back_to_idle(server.url)
    time.sleep(0.5)
    assert generated_tokens(server.url) - before < body["max_tokens"]   # neither request ran to the end
    assert aborted_sequences(server.url) - aborted_before == 2             # and /metrics counts both


def test_tokenize_detokenize_round_trip(server, llm):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = "Hello, tokenizer!"
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": text}, headers=headers).json()
    assert r["tokens"] == llm.tokenizer.encode(text) and r["count"] == len(r["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=headers).json()
    assert back["prompt"] == text
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}, headers=headers).json()
    assert chat["count"] == len(chat_reference(llm, CHAT, 1).prompt_token_ids)


def test_ping_and_version_answer_without_the_api_key(server):
    import atlasjax
    assert httpx.get(server.url + "/version").json() == {"version": atlasjax.__version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/ping")
        assert r.status_code == 200 and r.content == b""
    assert httpx.get(server.url + "/metrics").status_code == 401      # the key still guards the rest


def test_metrics_and_openapi(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
    r = httpx.get(server.url + "/metrics", headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("atlasjax_http_requests_total", "atlasjax_prompt_tokens_total", "atlasjax_generation_tokens_total",
                 "atlasjax_time_to_first_token_seconds_bucket", "atlasjax_inter_token_latency_seconds_bucket",
                 "atlasjax_num_requests_waiting", "atlasjax_kv_pages_used", "atlasjax_prefix_cache_hit_rate",
                 "atlasjax_prefix_cache_queries_total", "atlasjax_prefix_cache_hits_total",
                 "atlasjax_num_preemptions_total"):
        assert name in r.text, name
    assert 'atlasjax_http_requests_total{endpoint="/v1/chat/completions",status="200"}' in r.text
    assert metric_value(r.text, "atlasjax_generation_tokens_total") > 0
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/metrics"} <= set(spec["paths"])


def test_openapi_describes_every_route():
    from serving import (anthropic_routes, embeddings_routes, generate_routes, invocations, lora_routes,
                         openai_routes, responses_routes, utility_routes, weight_routes)
    from serving.openapi import openapi_schema
    paths = openapi_schema()["paths"]
    for route in (openai_routes.ROUTES + responses_routes.ROUTES + anthropic_routes.ROUTES + utility_routes.ROUTES
                  + invocations.ROUTES + generate_routes.ROUTES
                  + utility_routes.SLEEP_ROUTES + utility_routes.PROFILE_ROUTES + embeddings_routes.ROUTES
                  + lora_routes.ROUTES + weight_routes.ROUTES):
        path = re.sub(r":\w+}", "}", route.path)      # {model:path} -> {model}
        for method in route.methods - {"HEAD"}:
            assert method.lower() in paths.get(path, {}), (path, method)


def test_per_sequence_metrics_count_each_finished_sequence(server, client, llm):
    """vLLM's per-request histograms: one finished request of n=2 adds two sequences, with its prompt and
    generated lengths, and phases that add up (prefill + decode = inference)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    names = [f"atlasjax_request_{m}" for m in ("prompt_tokens_count", "prompt_tokens_sum", "generation_tokens_count",
                                               "generation_tokens_sum", "time_per_output_token_seconds_count",
                                               "prefill_time_seconds_sum", "decode_time_seconds_sum",
                                               "inference_time_seconds_sum")]

    def sample():
        text = httpx.get(server.url + "/metrics", headers=headers).text
        return {name: metric_value(text, name) for name in names}, metric_value(text, "atlasjax_kv_cache_usage_perc")
    before, _ = sample()
    prompt = "Counting: one two three"
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, n=2, temperature=0.7, seed=3,
                              extra_body={"ignore_eos": True})
    after, usage = sample()
    grew = {name.removeprefix("atlasjax_request_"): after[name] - before[name] for name in names}
    assert grew["prompt_tokens_count"] == grew["generation_tokens_count"] == 2
    assert grew["prompt_tokens_sum"] == 2 * len(llm.tokenizer.encode(prompt))
    assert grew["generation_tokens_sum"] == 10 and grew["time_per_output_token_seconds_count"] == 2
    assert grew["prefill_time_seconds_sum"] > 0 and grew["decode_time_seconds_sum"] > 0
    assert grew["inference_time_seconds_sum"] == pytest.approx(
        grew["prefill_time_seconds_sum"] + grew["decode_time_seconds_sum"], abs=1e-6)
    assert 0.0 <= usage <= 1.0


def test_multi_step_server_streams_the_same_text_in_bursts(request, tmp_path_factory, llm):
    # --num-scheduler-steps 4: warmed up with its multi-step decodes; a greedy stream's text, logprobs
    # and usage equal one step per launch, with up to 4 tokens per chunk.
    server = shared_server(request, tmp_path_factory, "multistep", "--num-scheduler-steps", "4")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ref = chat_reference(llm, CHAT, 12, logprobs=1)
    chunks = list(c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=12, temperature=0,
                                            logprobs=True, stream=True, stream_options={"include_usage": True}))
    per_chunk = [c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [e.logprob for entries in per_chunk for e in entries] == pytest.approx(
        [lp[t].logprob for lp, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)], abs=1e-4)
    assert max(len(entries) for entries in per_chunk) == 4
    assert chunks[-1].usage.completion_tokens == 12


def test_logit_bias_steers_completions_and_chat(client, llm):
    token = llm.engine.tokenizer.encode(" blue", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=4, temperature=0,
                                  logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " blue" * 4
    ref = chat_reference(llm, CHAT, 3)
    first = ref.outputs[0].token_ids[0]
    c = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0,
                                       logit_bias={str(first): -100})
    assert c.choices[0].message.content != ref.outputs[0].text

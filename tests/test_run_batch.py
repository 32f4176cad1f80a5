"""`python -m atlasjax run-batch`: OpenAI Batch API files answered offline (serving/batch.py).

A user hands over a JSONL file of requests and reads back one answer line per request, in input order, keyed by
custom_id: generation answers equal the engine's own greedy output, embeddings are there, a bad request or a
line that is not one gets an error line while the others are still answered, and bad flags stop the run before
any model loads.
"""
from __future__ import annotations

import json

import pytest

from atlasjax.__main__ import main
from serving.batch import BatchLineError, parse_line
from tests.server_util import ENGINE_KWARGS, MODEL_NAME, engine_flags, greedy_reference, reference_llm, tiny_model_dir

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "def main():", "Dear diary,"]


def _line(custom_id, url, body, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


GOOD = [_line(f"gen-{i}", "/v1/completions", {"model": MODEL_NAME, "prompt": p, "max_tokens": 6, "temperature": 0})
        for i, p in enumerate(PROMPTS)]
GOOD.insert(2, _line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}],
                                                      "max_tokens": 5, "temperature": 0}))
GOOD.insert(4, _line("emb", "/v1/embeddings", {"input": ["a query", "a document"]}))
BAD = [
    "this is not json",
    _line("no-route", "/v1/models", {}),
    json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),     # no custom_id
    _line("stream", "/v1/completions", {"prompt": "x", "stream": True}),
    _line("bad-model", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    _line("too-long", "/v1/completions", {"prompt": "word " * 400, "max_tokens": 3}),
    _line("bad-field", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
]
LINES = GOOD[:3] + BAD + GOOD[3:]      # bad lines among good ones, more than --max-concurrency in all


@pytest.fixture(scope="module")
def batch_output(tmp_path_factory) -> list[dict]:
    """The answers to LINES, run with 3 requests in flight (the window refills while answers are written)."""
    tmp = tmp_path_factory.mktemp("run_batch")
    src, dst = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("\n".join(LINES) + "\n\n")   # a blank line at the end is no request
    argv = ["run-batch", "-i", str(src), "-o", str(dst), "--model", tiny_model_dir(tmp_path_factory),
            "--served-model-name", MODEL_NAME, *engine_flags(ENGINE_KWARGS), "--max-concurrency", "3"]
    assert main(argv) == 0
    return [json.loads(text) for text in dst.read_text().splitlines()]


def test_batch_answers_each_line_in_order_as_the_engine_would(batch_output, tmp_path_factory):
    out = [o for o in batch_output if o["custom_id"] in {json.loads(t)["custom_id"] for t in GOOD}]
    assert [o["custom_id"] for o in out] == [json.loads(text)["custom_id"] for text in GOOD]
    assert all(o["error"] is None and o["response"]["status_code"] == 200 for o in out)
    assert len({o["id"] for o in batch_output}) == len(batch_output)
    by_id = {o["custom_id"]: o["response"]["body"] for o in out}
    want = greedy_reference(reference_llm(tmp_path_factory), PROMPTS, 6)
    for i, ref in enumerate(want):
        body = by_id[f"gen-{i}"]
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == ref.outputs[0].text
        assert body["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)
    assert by_id["chat"]["choices"][0]["message"]["role"] == "assistant"
    assert by_id["chat"]["usage"]["completion_tokens"] == 5
    vectors = [d["embedding"] for d in by_id["emb"]["data"]]
    assert len(vectors) == 2 and len(vectors[0]) == 64 and vectors[0] != vectors[1]


def test_bad_lines_get_error_lines_in_place(batch_output):
    assert len(batch_output) == len(LINES)
    out = batch_output[3:3 + len(BAD)]
    assert [o["custom_id"] for o in out] == [None, "no-route", None, "stream", "bad-model", "too-long", "bad-field"]
    for o in out[:4]:        # not requests at all: no response, the reason in error
        assert o["response"] is None and o["error"]["code"] == "invalid_batch_line", o
    assert "JSON" in out[0]["error"]["message"]
    assert "/v1/models" in out[1]["error"]["message"]
    assert "custom_id" in out[2]["error"]["message"]
    assert "stream" in out[3]["error"]["message"]
    for o in out[4:]:        # requests the API refuses: its status, its error object
        assert o["response"]["status_code"] == 400 and o["response"]["body"] is None, o
        assert o["error"]["type"] == "invalid_request_error" and o["error"]["message"], o
    assert out[4]["error"]["param"] == "model"
    assert "256" in out[5]["error"]["message"], out[5]     # the engine's max_model_len


def test_parse_line_names_what_is_wrong():
    ok = parse_line(_line("x", "/v1/embeddings", {"input": "a"}))
    assert (ok.custom_id, ok.url, json.loads(ok.body)) == ("x", "/v1/embeddings", {"input": "a"})
    assert parse_line(json.dumps({"custom_id": "y", "url": "/rerank", "body": {}})).url == "/rerank"  # POST default
    cases = {"[1, 2]": "JSON object", _line("", "/v1/completions", {}): "custom_id",
             _line("x", "/v1/completions", {}, method="GET"): "POST",
             _line("x", "/v1/completions", "text"): "body"}
    for text, words in cases.items():
        with pytest.raises(BatchLineError, match=words):
            parse_line(text)


def test_bad_flags_stop_before_the_model_loads(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["run-batch", "-i", str(src), "-o", str(src)]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "o.jsonl"), "--max-concurrency", "0"]) == 2
    assert "--max-concurrency" in capsys.readouterr().err
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "o.jsonl"), "--lora-modules", "a=/x"]) == 2
    assert "--enable-lora" in capsys.readouterr().err
    assert src.read_text().startswith("{")     # the input is untouched


def test_a_long_answer_holds_up_no_other_line_and_the_output_keeps_input_order():
    """With 2 in flight, line 0's request waits until three later lines were answered: the runner must start
    each next line as soon as any ends (not when the oldest does), and still write line 0's answer first."""
    import asyncio

    from serving.batch import run_lines
    served, three_done = [], asyncio.Event()

    async def app(scope, receive, send):       # a stand-in server: echoes the body's n
        n = json.loads((await receive())["body"])["n"]
        if n == 0:
            await three_done.wait()
        served.append(n)
        if len(served) == 3:
            three_done.set()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"r%d" % n)]})
        await send({"type": "http.response.body", "body": json.dumps({"n": n}).encode()})

    written = []
    lines = [_line(f"c{n}", "/v1/completions", {"n": n}) for n in range(5)]
    tally = asyncio.run(asyncio.wait_for(run_lines(app, lines, written.append, max_concurrency=2), timeout=30))
    assert served[:3] == [1, 2, 3] and sorted(served) == list(range(5))   # line 0 ended after three later ones
    assert [o["custom_id"] for o in written] == [f"c{n}" for n in range(5)]
    assert [o["response"]["body"]["n"] for o in written] == list(range(5))
    assert written[0]["response"]["request_id"] == "r0" and tally.answered == 5

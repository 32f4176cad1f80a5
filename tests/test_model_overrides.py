"""What a user sets beside the model's own files.

- Its generation_config.json: its end ids end sequences, its sampling settings become the defaults of
  requests that leave them out (LLM, the OpenAI and Anthropic routes), `LLM.save` keeps them, and
  `generation_config="vllm"` ignores them; a damaged file is a clear error.
- `--chat-template` (a file or the template itself) instead of the model's, and a request's
  `chat_template_kwargs` (Qwen3's `enable_thinking`)."""
from __future__ import annotations

import json
import os

import httpx
import pytest

from atlasjax import LLM
from atlasjax.errors import CheckpointError, EngineConfigError
from atlasjax.generation_config import GenerationDefaults, parse, read, resolve
from atlasjax.sampling_params import SamplingParams
from serving.protocol import Fields, sampling_params
from tests.server_util import ASSETS, MODEL_NAME, ServerProcess, tiny_model_dir

KW = dict(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64)
PROMPT = "The quick brown fox"
QWEN3_TEMPLATE = os.path.join(ASSETS, "chat_templates", "Qwen-Qwen3-0.6B.jinja")


def _model_with(tmp_path_factory, name: str, generation: dict) -> str:
    """The tiny Llama 3 model (tests/server_util.py) beside a generation_config.json of our own."""
    src = tiny_model_dir(tmp_path_factory)
    out = tmp_path_factory.mktemp(name)
    for f in os.listdir(src):
        os.symlink(os.path.join(src, f), out / f)
    (out / "generation_config.json").write_text(json.dumps(generation))
    return str(out)


# ---- the file


def test_parse_takes_what_vllm_takes():
    g = parse({"eos_token_id": [128001, 128009], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.05, "max_new_tokens": 512, "do_sample": True, "bos_token_id": 1,
               "num_beams": 1, "transformers_version": "4.45"}, "here")
    assert g.eos_token_ids == (128001, 128009) and g.max_tokens == 512
    assert g.sampling_defaults == dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.05)
    assert parse({"eos_token_id": 2, "temperature": None}, "here") == GenerationDefaults((2,), (), None, "here")
    assert not parse({"bos_token_id": 1, "transformers_version": "4.45"}, "here")   # nothing to apply


@pytest.mark.parametrize("data, field", [
    ({"temperature": "hot"}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": 2.5}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"eos_token_id": "</s>"}, "eos_token_id"),
    ({"eos_token_id": [1, -2]}, "eos_token_id"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": True}, "temperature")])
def test_bad_values_are_checkpoint_errors_naming_the_field(data, field):
    with pytest.raises(CheckpointError, match=field):
        parse(data, "generation_config.json")


def test_unreadable_files_are_checkpoint_errors(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        resolve("auto", str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        read(str(tmp_path / "generation_config.json"))


def test_settings(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert resolve("auto", str(tmp_path)).sampling_defaults == {"temperature": 0.7}
    assert not resolve("vllm", str(tmp_path))                    # ignored
    assert not resolve("auto", str(tmp_path / "model.gguf"))     # a file model: none beside it
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"top_k": 5}))
    assert resolve(str(other), "preset:tiny").sampling_defaults == {"top_k": 5}   # any model
    assert resolve(str(tmp_path), "preset:tiny").sampling_defaults == {"temperature": 0.7}
    with pytest.raises(EngineConfigError, match="generation_config"):
        LLM(None, generation_config=str(tmp_path / "missing"))


def test_server_fields_fall_back_to_the_model_then_openai():
    model = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    p = sampling_params(Fields({}), max_tokens=None, max_model_len=64, model_defaults=model)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.min_p) == (0.6, 20, 1.0, 1.1, 0.0)
    p = sampling_params(Fields({"temperature": 0, "top_k": -1, "top_p": 0.5}), max_tokens=None, max_model_len=64,
                        model_defaults=model)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.0, 0, 0.5, 1.1)   # the request wins
    p = sampling_params(Fields({}), max_tokens=None, max_model_len=64)
    assert (p.temperature, p.top_k, p.repetition_penalty) == (1.0, 0, 1.0)


def test_override_generation_config_sets_keys_over_the_file(tmp_path_factory):
    """vLLM's --override-generation-config: its keys over the file's (the others stay), over none with "vllm"; a key
    it does not take or a value out of range is refused before anything loads."""
    from atlasjax.__main__ import build_parser, engine_kwargs
    model = _model_with(tmp_path_factory, "overridden", {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64})
    args = build_parser().parse_args(["serve", "--model", model, "--override-generation-config",
                                      '{"temperature": 0.2, "max_new_tokens": 7}'])
    kwargs = {k: v for k, v in engine_kwargs(args).items() if k not in KW and k != "model"}
    p = LLM(model, **{**kwargs, **KW}).get_default_sampling_params()
    assert (p.temperature, p.top_p, p.max_tokens) == (0.2, 0.9, 7)
    llm = LLM(model, generation_config="vllm", override_generation_config={"top_k": 5}, **KW)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 5)
    for bad, says in (({"do_sample": True}, "not supported"), ({"temperature": -1}, "temperature"),
                      ("{not json", "not valid JSON")):
        with pytest.raises(EngineConfigError, match=says):
            LLM("/no/such/model", override_generation_config=bad)


# ---- an engine on a model with the file


@pytest.fixture(scope="module")
def reference_tokens(tmp_path_factory):
    """Greedy tokens of the tiny model with its file ignored (no end ids of its own are hit)."""
    llm = LLM(tiny_model_dir(tmp_path_factory), generation_config="vllm", **KW)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.finish_reason == "length"
    return out.token_ids


def test_end_ids_of_the_file_end_sequences_and_save_keeps_them(tmp_path_factory, reference_tokens):
    j = next(i for i in range(2, len(reference_tokens)) if reference_tokens[i] not in reference_tokens[:i])
    model = _model_with(tmp_path_factory, "gen_eos", {"eos_token_id": [reference_tokens[j]], "top_k": 1})
    llm = LLM(model, **KW)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    out = llm.generate(PROMPT, greedy)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[:j] == reference_tokens[:j] and len(out.token_ids) <= j + 1
    assert llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0] \
        .token_ids == reference_tokens
    # no SamplingParams: the model's (top_k 1 makes temperature 1.0 greedy)
    assert llm.get_default_sampling_params().top_k == 1
    assert llm.generate(PROMPT)[0].outputs[0].token_ids == out.token_ids
    saved = str(tmp_path_factory.mktemp("gen_saved"))
    llm.save(saved)
    again = LLM(saved, **KW)
    assert again.get_default_sampling_params().top_k == 1
    assert again.generate(PROMPT, greedy)[0].outputs[0].token_ids == out.token_ids
    ignored = LLM(model, generation_config="vllm", **KW)
    assert ignored.generate(PROMPT, greedy)[0].outputs[0].token_ids == reference_tokens
    assert ignored.get_default_sampling_params() == SamplingParams()


# ---- the server


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    model = _model_with(tmp_path_factory, "gen_server", {"top_k": 1, "temperature": 0.9, "max_new_tokens": 5})
    if not os.path.exists(QWEN3_TEMPLATE):
        pytest.skip(f"test assets not found: {QWEN3_TEMPLATE}")
    proc = ServerProcess(model, str(tmp_path_factory.mktemp("gen_server_log") / "server.log"),
                         "--chat-template", QWEN3_TEMPLATE)
    request.addfinalizer(proc.stop)
    return proc


def _post(server, path, body):
    r = httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_requests_take_the_models_defaults(server):
    assert "defaults for requests that leave them out" in server.log() and "top_k=1" in server.log()
    messages = [{"role": "user", "content": "Name a colour."}]
    greedy = _post(server, "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 5})
    # temperature 0.9 by default, but top_k 1 by default: greedy; max_tokens left out: the model's 5
    plain = _post(server, "/v1/chat/completions", {"messages": messages, "seed": 3})
    assert plain["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    assert plain["usage"]["completion_tokens"] == greedy["usage"]["completion_tokens"] <= 5
    longer = _post(server, "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 9})
    assert longer["usage"]["completion_tokens"] > 5 or longer["choices"][0]["finish_reason"] == "stop"
    text = _post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 6})
    assert _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "seed": 1})["choices"][0]["text"] \
        == text["choices"][0]["text"]
    anthropic = _post(server, "/v1/messages", {"messages": messages, "max_tokens": 5, "temperature": 0})
    assert _post(server, "/v1/messages", {"messages": messages, "max_tokens": 5})["content"] == anthropic["content"]


# ---- the chat template


def test_chat_template_from_a_file_or_inline_and_save_keeps_it(tmp_path_factory):
    if not os.path.exists(QWEN3_TEMPLATE):
        pytest.skip(f"test assets not found: {QWEN3_TEMPLATE}")
    model = tiny_model_dir(tmp_path_factory)
    chat = [{"role": "user", "content": "Hi"}]
    llm = LLM(model, chat_template=QWEN3_TEMPLATE, **KW)
    assert llm.tokenizer.apply_chat_template(chat) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert llm.tokenizer.apply_chat_template(chat, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    saved = str(tmp_path_factory.mktemp("template_saved"))
    llm.save(saved)
    assert LLM(saved, **KW).tokenizer.apply_chat_template(chat).startswith("<|im_start|>user")
    inline = LLM(model, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}", **KW)
    assert inline.tokenizer.apply_chat_template(chat) == "[Hi]"
    out = inline.chat(chat, SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.prompt_token_ids == inline.tokenizer.encode("[Hi]", add_special_tokens=False)


@pytest.mark.parametrize("value, message", [("/no/such/template.jinja", "not found"),
                                            ("{% for m in messages %}", "does not compile")])
def test_bad_chat_templates_fail_before_loading(value, message):
    with pytest.raises(EngineConfigError, match=message):
        LLM("/no/such/model", chat_template=value)


def test_server_renders_the_given_template_with_the_requests_variables(server):
    messages = [{"role": "user", "content": "Hi"}]

    def rendered(**body):
        tokens = _post(server, "/tokenize", {"messages": messages, **body})["tokens"]
        return _post(server, "/detokenize", {"tokens": tokens})["prompt"]
    assert rendered().startswith("<|im_start|>user\nHi<|im_end|>") and "<think>" not in rendered()
    assert rendered(chat_template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    thinking_off = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0,
                                                         "chat_template_kwargs": {"enable_thinking": False}})
    plain = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0})
    assert thinking_off["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    for kwargs in ({"messages": []}, {"add_generation_prompt": False}, {"continue_final_message": True},
                   {"tools": []}, {"1x": 1}, [1]):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "messages": messages, "max_tokens": 2, "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text

"""Request parsing and validation shared by the OpenAI and Anthropic routes.

A request body goes: raw bytes -> `parse_json_object` -> `Fields` (typed access, every mistake a
400 naming the field) -> `SamplingParams` (which checks the ranges) plus prompts or chat
messages. Nothing here talks to the engine; handlers tokenize and submit.
"""
from __future__ import annotations

import json
import math

from atlasjax.errors import InvalidRequestError
from atlasjax.sampling_params import (SamplingParams, check_truncate_prompt_tokens, parse_allowed_token_ids,
                                      parse_bad_words, parse_logit_bias)
from serving.errors import invalid

INT32_MAX = 2**31 - 1
MAX_N = 128                 # completions per prompt
MAX_STOP_STRINGS = 64
MISSING = object()


def parse_json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise invalid(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


class Fields:
    """Typed, optional access to the fields of one JSON object. null counts as absent."""

    def __init__(self, body: dict):
        self.body = body

    def raw(self, name: str, default=None):
        value = self.body.get(name)
        return default if value is None else value

    def int(self, name: str, default=None, *, lo: int | None = None, hi: int | None = None):
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"'{name}' must be an integer, got {_show(value)}", param=name)
        _check_range(name, value, lo, hi)
        return value

    def float(self, name: str, default=None, *, lo: float | None = None, hi: float | None = None):
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise invalid(f"'{name}' must be a finite number, got {_show(value)}", param=name)
        _check_range(name, value, lo, hi)
        return float(value)

    def bool(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(f"'{name}' must be true or false, got {_show(value)}", param=name)
        return value

    def str(self, name: str, default=None):
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise invalid(f"'{name}' must be a string, got {_show(value)}", param=name)
        return value

    def object(self, name: str) -> dict | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, dict):
            raise invalid(f"'{name}' must be an object, got {_show(value)}", param=name)
        return value

    def str_list(self, name: str, *, max_items: int) -> list[str]:
        """A string or a list of strings (stop sequences)."""
        value = self.body.get(name)
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise invalid(f"'{name}' must be a string or a list of strings", param=name)
        if len(items) > max_items:
            raise invalid(f"'{name}' has {len(items)} entries; at most {max_items} are supported", param=name)
        if any(not s for s in items):
            raise invalid(f"'{name}' entries must be non-empty strings", param=name)
        return items


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_range(name, value, lo, hi) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise invalid(f"'{name}' must be in {bounds}, got {value}", param=name)


def check_model(f: Fields, served_model_names: tuple[str, ...]) -> str:
    """The request's `model`: one of the served names (vLLM's `--served-model-name` may give several), or the
    first when left out."""
    model = f.str("model", served_model_names[0])
    if model not in served_model_names:
        names = ", ".join(f"'{name}'" for name in served_model_names)
        raise invalid(f"the model '{model}' does not exist; this server serves {names}", param="model",
                      code="model_not_found")
    return model


def sampling_params(f: Fields, *, max_tokens: int | None, max_model_len: int, logprobs: int | None = None,
                    stop_field: str = "stop", n: int = 1, prompt_logprobs: int | None = None,
                    model_defaults: dict | None = None) -> SamplingParams:
    """The sampling fields OpenAI and vLLM clients send. An absent one takes the model's default
    (`model_defaults`: its generation_config.json, atlasjax/generation_config.py), else OpenAI's."""
    default = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
               **(model_defaults or {})}
    kwargs = dict(
        n=n, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        temperature=f.float("temperature", default["temperature"]),
        top_p=f.float("top_p", default["top_p"]),
        top_k=f.int("top_k", default["top_k"], lo=-1, hi=INT32_MAX),
        min_p=f.float("min_p", default["min_p"]),
        presence_penalty=f.float("presence_penalty", 0.0),
        frequency_penalty=f.float("frequency_penalty", 0.0),
        repetition_penalty=f.float("repetition_penalty", default["repetition_penalty"]),
        seed=f.int("seed"),
        stop=f.str_list(stop_field, max_items=MAX_STOP_STRINGS),
        stop_token_ids=_token_ids(f, "stop_token_ids"),
        min_tokens=f.int("min_tokens", 0, lo=0, hi=max_model_len),
        ignore_eos=f.bool("ignore_eos"),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        include_stop_str_in_output=f.bool("include_stop_str_in_output"),
        truncate_prompt_tokens=f.int("truncate_prompt_tokens", None, lo=-1),   # (vLLM's; 0 is refused below)
    )
    for name, parse in (("logit_bias", lambda: parse_logit_bias(f.object("logit_bias"))),  # {"token id": bias}
                        ("allowed_token_ids", lambda: parse_allowed_token_ids(f.raw("allowed_token_ids"))),
                        ("bad_words", lambda: parse_bad_words(f.raw("bad_words"))),
                        ("truncate_prompt_tokens", lambda: check_truncate_prompt_tokens(
                            kwargs["truncate_prompt_tokens"]))):
        try:
            kwargs[name] = parse()
        except InvalidRequestError as e:
            raise invalid(str(e), param=name) from None
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        raise invalid(str(e)) from None


# variables the server sets itself, and tools (not supported yet, as the `tools` field)
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token",
                            "tools")


def chat_render_options(f: Fields) -> dict:
    """How an OpenAI-style chat request asks its messages to be rendered (vLLM's extra fields):
    `chat_template_kwargs` (more template variables: Qwen3's `enable_thinking`), `add_generation_prompt`
    (default true) and `continue_final_message` (the last, assistant, message stays open to continue)."""
    kwargs = f.object("chat_template_kwargs") or {}
    taken = [k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS]
    if taken:
        raise invalid(f"'chat_template_kwargs' may not set {', '.join(taken)}", param="chat_template_kwargs")
    if not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise invalid("'chat_template_kwargs' keys must be identifiers", param="chat_template_kwargs")
    continue_final = f.bool("continue_final_message")
    if continue_final and f.bool("add_generation_prompt"):
        raise invalid("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                      param="continue_final_message")
    return dict(template_kwargs=kwargs, continue_final_message=continue_final,
                add_generation_prompt=f.bool("add_generation_prompt", True))


def _token_ids(f: Fields, name: str) -> list[int]:
    value = f.raw(name, [])
    if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
        raise invalid(f"'{name}' must be a list of token ids", param=name)
    return value


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX


def completion_prompts(f: Fields, name: str = "prompt") -> list[str | list[int]]:
    """`prompt` (or the embeddings' `input`): a string, a list of strings, a list of token ids, or a list of
    token-id lists."""
    value = f.body.get(name)
    if isinstance(value, str):
        prompts = [value]
    elif isinstance(value, list) and value and all(_is_token_id(t) for t in value):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = value
    elif isinstance(value, list) and value and all(
            isinstance(p, list) and all(_is_token_id(t) for t in p) for p in value):
        prompts = value
    else:
        raise invalid(f"'{name}' must be a string, a list of strings, a list of token ids or a list of "
                      "token-id lists", param=name)
    if any(len(p) == 0 for p in prompts):
        raise invalid(f"'{name}' must not be empty", param=name)
    return prompts


def text_content(content, param: str, allowed_types=("text",)) -> str:
    """A message's content: a string, or a list of text parts (joined with newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{param}' must be a string or a list of content parts", param=param)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"'{param}[{i}]' must be an object with a 'type'", param=param)
        if part["type"] not in allowed_types:
            raise invalid(f"content parts of type '{part['type']}' are not supported; only text is", param=param)
        if not isinstance(part.get("text"), str):
            raise invalid(f"'{param}[{i}].text' must be a string", param=param)
        texts.append(part["text"])
    return "\n".join(texts)

"""The OpenAI Responses API's request side: `input` and `instructions` as chat messages, and the
fields this server refuses.

`input` is a string (one user message) or a list of items. A message item is {role, content}
(optionally "type": "message"), its content a string or a list of text parts (`input_text`,
`output_text`, `text`). Reasoning items of earlier turns are dropped, as chat templates drop earlier
turns' thinking. Tool calls, images, files and the other item types are refused with a 400 naming
the item. `instructions` becomes a leading system message; it is not carried to later responses
chained with `previous_response_id` (OpenAI's rule).
"""
from __future__ import annotations

from serving.errors import invalid
from serving.protocol import Fields, text_content

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
EARLIER_REASONING = ("reasoning",)
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def check_supported(f: Fields) -> None:
    """400 for what the route cannot do yet: tools, structured outputs, background runs, conversations."""
    if f.body.get("tools"):
        raise invalid("tools and function calling are not supported yet", param="tools")
    if f.body.get("tool_choice") not in (None, "none", "auto"):
        raise invalid("tool_choice is not supported yet (only 'none' or 'auto' with no tools)", param="tool_choice")
    fmt = (f.object("text") or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise invalid("structured outputs (text.format other than text) are not supported yet", param="text.format")
    if f.bool("background"):
        raise invalid("background responses are not supported", param="background")
    for name in ("conversation", "prompt"):
        if f.body.get(name) is not None:
            raise invalid(f"'{name}' is not supported; send the conversation as 'input' or chain it with "
                          "'previous_response_id'", param=name)
    if f.str("truncation", "disabled") not in ("disabled", "auto"):
        raise invalid("'truncation' must be 'disabled' or 'auto'", param="truncation")
    include = f.raw("include", [])
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise invalid("'include' must be a list of strings", param="include")
    others = [x for x in include if x != LOGPROBS_INCLUDE]
    if others:
        raise invalid(f"'include' values other than {LOGPROBS_INCLUDE} are not supported: {', '.join(others)}",
                      param="include")
    metadata = f.object("metadata") or {}
    if len(metadata) > 16 or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                                     for k, v in metadata.items()):
        raise invalid("'metadata' holds at most 16 string values (keys up to 64 characters, values up to 512)",
                      param="metadata")


def wants_logprobs(f: Fields) -> bool:
    return LOGPROBS_INCLUDE in f.raw("include", []) or f.body.get("top_logprobs") is not None


def instructions_message(f: Fields) -> list[dict]:
    instructions = f.body.get("instructions")
    if instructions is None:
        return []
    return [{"role": "system", "content": text_content(instructions, "instructions", TEXT_PARTS)}]


def input_messages(f: Fields) -> list[dict]:
    """The request's own `input` as chat messages ({role, content: str}), in order."""
    value = f.body.get("input")
    if isinstance(value, str):
        if not value:
            raise invalid("'input' must not be empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("'input' must be a string or a non-empty list of items", param="input")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise invalid(f"'input[{i}]' must be an object", param="input")
        kind = item.get("type", "message")
        if kind in EARLIER_REASONING:
            continue
        if kind != "message":
            what = "tool calls and their outputs are" if "call" in str(kind) else f"input items of type '{kind}' are"
            raise invalid(f"{what} not supported yet; only messages", param=f"input[{i}]")
        role = item.get("role")
        if role not in ROLES:
            raise invalid(f"'input[{i}].role' must be one of {', '.join(ROLES)}", param=f"input[{i}].role")
        content = item.get("content")
        if role == "assistant" and isinstance(content, list):   # an earlier answer's refusal parts carry no text
            content = [p for p in content if not (isinstance(p, dict) and p.get("type") == "refusal")]
        text = text_content(content, f"input[{i}].content", TEXT_PARTS)
        out.append({"role": "system" if role == "developer" else role, "content": text})
    if not out:
        raise invalid("'input' holds no message", param="input")
    return out

"""Prompts as `LLM` takes them: text, token ids, or vLLM's prompt dicts (`{"prompt": text}` /
`{"prompt_token_ids": ids}`, each optionally with a `cache_salt`), one or a list of them."""
from __future__ import annotations

from atlasjax.errors import InvalidRequestError

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_list(prompts) -> list:
    """One prompt or a list of them, as a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def split_prompt(prompt) -> tuple[str | list[int], str | None]:
    """A prompt's text or token ids, and its cache salt (None: the shared prefix cache)."""
    if not isinstance(prompt, dict):
        return prompt, None
    given = [k for k in PROMPT_KEYS if k in prompt]
    if len(given) != 1:
        raise InvalidRequestError(f"a prompt dict needs one of 'prompt' (text) or 'prompt_token_ids', got keys "
                                  f"{sorted(prompt)}")
    unknown = sorted(set(prompt) - {*PROMPT_KEYS, "cache_salt"})
    if unknown:
        raise InvalidRequestError(f"prompt dict keys {unknown} are not supported (only 'prompt' or "
                                  "'prompt_token_ids', and 'cache_salt')")
    value = prompt[given[0]]
    if given[0] == "prompt" and not isinstance(value, str):
        raise InvalidRequestError(f"'prompt' must be text, got {type(value).__name__}")
    if given[0] == "prompt_token_ids" and (isinstance(value, str) or not hasattr(value, "__len__")):
        raise InvalidRequestError(f"'prompt_token_ids' must be a list of token ids, got {type(value).__name__}")
    return (value if isinstance(value, str) else list(value)), check_cache_salt(prompt.get("cache_salt"))


def plain_prompt(prompt) -> str | list[int]:
    """A prompt without its cache salt (embeddings and forward passes share no cache)."""
    return split_prompt(prompt)[0]


def check_cache_salt(salt) -> str | None:
    """vLLM's `cache_salt`: requests reuse cached prefix pages only from requests with the same salt (None: the
    shared cache), so tenants cannot learn from cache timing what others sent."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt

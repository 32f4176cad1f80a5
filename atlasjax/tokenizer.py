"""Tokenizer wrapper (HF `tokenizers`), sandboxed chat templates, and incremental detokenization."""
from __future__ import annotations

import copy
import datetime
import json
import os

import jinja2
import jinja2.sandbox
import tokenizers

from atlasjax.errors import CheckpointError, EngineConfigError, InvalidRequestError


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _appended_ids(tok: tokenizers.Tokenizer) -> tuple[int, ...]:
    """Ids the tokenizer's post-processor appends to every text (an embedding model's EOS: Qwen3-Embedding
    pools the `<|endoftext|>` it appends, as Hugging Face's tokenizer adds it); () for most models."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[start + len(plain):])
    return ()


class Tokenizer:
    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 eos_token_ids=(), add_bos: bool = False, chat_template: str | None = None):
        self.tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        ids = list(eos_token_ids)
        if eos_token and tok.token_to_id(eos_token) is not None:
            ids.append(tok.token_to_id(eos_token))
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.suffix_ids = _appended_ids(tok)
        self._template = None

    # ---- construction
    @classmethod
    def from_dir(cls, model_dir: str, eos_token_ids=()) -> Tokenizer | None:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            return None
        try:
            tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exception)
            raise CheckpointError(f"cannot load {path}: {e}") from e
        cfg = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        bos = _token_str(cfg.get("bos_token"))
        return cls(tok, bos_token=bos, eos_token=_token_str(cfg.get("eos_token")), eos_token_ids=eos_token_ids,
                   add_bos=bool(cfg.get("add_bos_token", False)) and bos is not None, chat_template=template)

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy that renders `template` (from `read_chat_template`) instead of the model's."""
        new = copy.copy(self)
        new.chat_template, new._template = template, None
        return new

    def __getstate__(self):   # the compiled template stays behind (an engine process sends the tokenizer)
        return {**self.__dict__, "_template": None}

    # ---- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and \
                (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        if add_special_tokens and self.suffix_ids and tuple(ids[-len(self.suffix_ids):]) != self.suffix_ids:
            ids = ids + list(self.suffix_ids)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(int(i))

    # ---- chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs) -> str:
        """continue_final_message: the text ends with the last (assistant) message's content, its turn
        left open, so the model continues it (Anthropic's prefill; vLLM's and transformers' option);
        add_generation_prompt does not apply then."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use a plain prompt instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        if continue_final_message:
            if not messages or messages[-1].get("role") != "assistant":
                raise InvalidRequestError("continue_final_message needs the last message to be the assistant's")
            final = messages[-1].get("content") or ""
            if not isinstance(final, str):
                raise InvalidRequestError("continue_final_message needs the last message's content as text")
            if not final.strip():   # nothing to continue: the assistant's turn starts afresh
                return self.apply_chat_template(messages[:-1], add_generation_prompt=True, **kwargs)
            text = self._render(messages, False, kwargs)
            for part in (final, final.strip()):   # templates may trim a message's content
                if part in text:
                    return text[:text.rindex(part) + len(part)]
            raise InvalidRequestError("the chat template changes the last assistant message, so it cannot be continued")
        return self._render(messages, add_generation_prompt, kwargs)

    def _render(self, messages, add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            # a request's messages or template variables the template cannot take: the request's fault
            raise InvalidRequestError(f"chat template error: {type(e).__name__}: {e}") from e


def read_chat_template(value: str) -> str:
    """`--chat-template`, as vLLM takes it: a file's path, or the template itself (anything with
    braces or a newline). The template must compile; an error names what is wrong."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise EngineConfigError(f"cannot read the chat template {value}: {e}") from e
    elif any(c in value for c in "{}\n"):
        template = value
    else:
        raise EngineConfigError(f"chat template file not found: {value}")
    try:
        _compile_template(template)
    except CheckpointError as e:
        raise EngineConfigError(f"the chat template given does not compile: {e.__cause__}") from None
    return template


def _raise(message):
    raise jinja2.TemplateError(message)


def _compile_template(source: str):
    # Sandboxed, as transformers renders chat templates: templates come with downloaded models.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, **kw)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise CheckpointError(f"the model's chat template does not compile: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a multi-byte character.

    Decodes a short window (prefix_offset..) twice, with and without the newest tokens; text is
    emitted only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""

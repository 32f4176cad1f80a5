"""What every handler needs: the engine, the served name, metrics, and prompt preparation.

`ServerState` lives on `app.state.server`. It tokenizes (off the event loop: long prompts and
chat templates take real CPU time) and checks a prompt against max_model_len before anything
is submitted, so length errors name the field they come from.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from starlette.requests import Request

from atlasjax.errors import InvalidRequestError
from atlasjax.prompts import check_cache_salt
from atlasjax.sampling_params import SamplingParams
from atlasjax.waiting_queue import check_priority
from serving.errors import invalid
from serving.metrics import ServerMetrics
from serving.protocol import check_model, parse_json_object
from serving.reasoning import END
from serving.response_store import ResponseStore
from serving.thinking_budget import CLOSE_TEXT, ThinkingBudget


@dataclasses.dataclass
class ServerState:
    llm: object                     # atlasjax.AsyncLLM
    model_name: str | tuple[str, ...]   # the served name, or several (the first is the main one)
    metrics: ServerMetrics
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    reasoning_parser: str | None = None   # serving/reasoning.py: splits chat answers' <think> part off
    return_tokens_as_token_ids: bool = False   # logprob entries name tokens `token_id:N` unless a request says
    incremental_streaming_output: bool = False   # /generate streams send deltas (SGLang's flag)
    force_include_usage: bool = False   # every OpenAI stream ends with a usage chunk (vLLM's flag)
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)   # the Responses API's `store`
    lora_modules: dict = dataclasses.field(default_factory=dict)   # adapter name -> LoRARequest (lora_routes.py)
    max_lora_rank: int | None = None    # the engine's, with LoRA enabled (None: no adapters)
    weight_version: str = "default"     # SGLang's: named by the last /update_weights_from_disk (weight_routes.py)
    weights_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)   # one weight update at a time
    generations: dict = dataclasses.field(default_factory=dict)   # rid -> the Event aborting a /generate prompt
    model_names: tuple[str, ...] = dataclasses.field(init=False, default=())   # every served name, main first
    _close_ids: tuple[int, ...] | None = None   # the reasoning budget's close tag, tokenized once
    _end_ids: tuple[int, ...] | None = None     # the reasoning's end tag alone, tokenized once

    def __post_init__(self):
        self.model_names = (self.model_name,) if isinstance(self.model_name, str) else tuple(self.model_name)
        if not self.model_names or not all(isinstance(n, str) and n for n in self.model_names):
            raise ValueError(f"served model names must be non-empty strings, got {self.model_name!r}")
        self.model_name = self.model_names[0]

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def generation_model(self, f) -> tuple[str, object]:
        """A generation request's `model` and its LoRA adapter: a served name (None), or an adapter's name."""
        model = check_model(f, self.model_names + tuple(self.lora_modules))
        return model, self.lora_modules.get(model) if model not in self.model_names else None

    def new_lora_id(self) -> int:
        return max((lora.lora_int_id for lora in self.lora_modules.values()), default=0) + 1

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.engine.model_config.vocab_size

    @property
    def model_defaults(self) -> dict:
        """The sampling defaults of the model's generation_config.json (empty if none or ignored)."""
        return self.llm.engine.generation_defaults.sampling_defaults

    def default_max_tokens(self, params: SamplingParams, ids: list[int]) -> SamplingParams:
        """A chat request that left max_tokens out: the model's max_new_tokens, cut to the context left
        after the prompt (as vLLM does); without one it runs to max_model_len."""
        wanted = self.llm.engine.generation_defaults.max_tokens
        if not wanted or len(ids) >= self.max_model_len:
            return params    # (an over-long prompt is refused by check_prompt)
        try:
            return dataclasses.replace(params, max_tokens=min(wanted, self.max_model_len - len(ids)))
        except InvalidRequestError as e:   # min_tokens above what is left
            raise invalid(str(e), param="min_tokens") from None

    def cache_salt(self, f) -> str | None:
        """A request's `cache_salt` (vLLM's): its prompt reuses cached prefix pages only from requests that sent the
        same salt, so one tenant cannot tell from timing what another's prompts held."""
        try:
            return check_cache_salt(f.raw("cache_salt"))
        except InvalidRequestError as e:
            raise invalid(str(e), param="cache_salt") from None

    def priority(self, f) -> int:
        """A request's `priority` (vLLM's extra field; lower is served sooner): any integer on a server
        started with --scheduling-policy priority; elsewhere only 0, as vLLM answers."""
        value = f.int("priority", 0)
        if value:       # (0 is every policy's default: no need to ask the engine)
            try:
                check_priority(value, self.llm.engine.scheduling_policy)
            except InvalidRequestError as e:
                raise invalid(str(e), param="priority") from None
        return value

    def tokens_as_ids(self, f) -> bool:
        """vLLM's `return_tokens_as_token_ids`: logprob entries (and echoed prompt tokens) name each token
        `token_id:N` instead of its text, for tokens that do not decode alone (the server's default, per request)."""
        return f.bool("return_tokens_as_token_ids", self.return_tokens_as_token_ids)

    def thinking_budget(self, tokens: int | None, param: str) -> ThinkingBudget | None:
        """A request's reasoning budget (serving/thinking_budget.py); it needs the reasoning parser."""
        if tokens is None:
            return None
        if self.reasoning_parser is None:
            raise invalid(f"'{param}' needs a server started with --reasoning-parser (qwen3 or deepseek_r1)",
                          param=param)
        if self._close_ids is None:
            self._close_ids = tuple(self.require_tokenizer().encode(CLOSE_TEXT, add_special_tokens=False))
        return ThinkingBudget(tokens, self.reasoning_parser, self._close_ids)

    def reasoning_end_ids(self) -> tuple[int, ...]:
        """The token ids of the reasoning's end tag (empty without a reasoning parser)."""
        if self.reasoning_parser is None or self.tokenizer is None:
            return ()
        if self._end_ids is None:
            self._end_ids = tuple(self.tokenizer.encode(END, add_special_tokens=False))
        return self._end_ids

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise invalid("this model has no tokenizer: send token ids instead of text")
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = self.require_tokenizer()
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)

    async def chat_prompt(self, messages: list[dict], param: str = "messages", template_kwargs: dict | None = None,
                          add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        """Render the chat template to text, then tokenize it without adding special tokens again.
        template_kwargs: more variables for the template (`chat_template_kwargs`, checked by the caller);
        continue_final_message: leave the last (assistant) message open for the model to continue."""
        tok = self.require_tokenizer()

        def render() -> list[int]:
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **(template_kwargs or {}))
            return tok.encode(text, add_special_tokens=False)
        try:
            return await asyncio.to_thread(render)
        except InvalidRequestError as e:
            raise invalid(str(e), param=param) from None

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str) -> None:
        if not ids:
            raise invalid("the prompt is empty", param=param)
        if max(ids) >= self.vocab_size:
            raise invalid(f"prompt token ids must be in [0, {self.vocab_size})", param=param)
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise invalid(f"stop_token_ids must be in [0, {self.vocab_size})", param="stop_token_ids")
        for name in ("logit_bias", "allowed_token_ids"):
            if getattr(params, name) and max(getattr(params, name)) >= self.vocab_size:
                raise invalid(f"{name} token ids must be in [0, {self.vocab_size})", param=name)
        limit = self.max_model_len
        if len(ids) >= limit:
            raise invalid(f"the prompt has {len(ids)} tokens; max_model_len={limit} allows at most {limit - 1}",
                          param=param, code="context_length_exceeded")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise invalid(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                          f"max_model_len={limit}", param="max_tokens", code="context_length_exceeded")


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def read_json(request: Request) -> dict:
    return parse_json_object(await request.body())


def new_id(prefix: str, request: Request | None = None) -> tuple[str, str]:
    """(response id, engine request id): prefix + the client's X-Request-Id when it sent one (as vLLM
    names its responses), else + random hex. The engine's id gets a random suffix after a client's id,
    so that a client reusing one (a retry while the first is still aborting) never collides."""
    given = getattr(request.state, "request_id", None) if request is not None else None
    if given is None:
        rid = f"{prefix}{uuid.uuid4().hex}"
        return rid, rid
    return f"{prefix}{given}", f"{prefix}{given}-{uuid.uuid4().hex[:8]}"


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event (OpenAI sends data only; Anthropic names each event)."""
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

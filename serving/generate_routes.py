"""SGLang's native routes, which RL frameworks drive their rollouts with: POST /generate (token ids in, token ids
out, no chat template), POST /abort_request, GET /get_model_info, GET /get_server_info, GET|POST /flush_cache and
GET /health_generate (/model_info and /server_info: SGLang's newer names).

/generate takes `text` (a string or a batch of them) or `input_ids` (one list of token ids or a batch), a
`sampling_params` object (or one per prompt) in SGLang's names (max_new_tokens, min_new_tokens, no_stop_trim,
sampling_seed...), `stream`, `rid`, `lora_path` (a loaded adapter's name), `return_logprob` with
`logprob_start_len`, `top_logprobs_num` and `return_text_in_logprobs`, and `return_prompt_token_ids`. It answers
{"text", "output_ids", "meta_info"} per sequence (a list for a batch or n > 1, prompt-major); a stream sends that
object, text and ids so far, after every step, then `data: [DONE]`. meta_info holds id, finish_reason ({"type":
"stop", "matched": token id or string} | {"type": "length", "length": N} | {"type": "abort", "message"} | null
while running), prompt_tokens, completion_tokens, cached_tokens, weight_version, e2e_latency at the end and, with
return_logprob, (logprob, token id, text or null) triples: output_token_logprobs, input_token_logprobs (from
logprob_start_len; the first prompt token has no logprob: null) and, with top_logprobs_num, the top ones per
position. POST /abort_request {"rid"} (or {"abort_all": true}) ends those prompts now: their answers come back
with what they generated and finish_reason {"type": "abort"}.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from atlasjax.outputs import Logprob
from atlasjax.sampling_params import MAX_LOGPROBS, SamplingParams
from serving.bridge import Completion, Job, first_delta, stream_jobs, until_disconnect, with_first
from serving.errors import APIError, invalid
from serving.openai_shapes import finite, ranked
from serving.protocol import INT32_MAX, MAX_N, Fields, sampling_params
from serving.state import SSE_HEADERS, ServerState, read_json, server_state, sse

DEFAULT_MAX_NEW_TOKENS = 128        # SGLang's
MAX_BATCH = 1024                    # prompts in one /generate
HEALTH_GENERATE_TIMEOUT_S = 20.0    # SGLang's
# SGLang's sampling parameter -> ours, where the names differ
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output",
           "sampling_seed": "seed"}
SAME_NAME = ("stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
             "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens", "logit_bias", "n")
STRUCTURED = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex")
NOT_SUPPORTED = ("input_embeds", "image_data", "video_data", "audio_data", "custom_logit_processor",
                 "return_hidden_states", "token_ids_logprob", "session_params")


@dataclasses.dataclass
class _Prompt:
    rid: str
    ids: list[int]
    params: SamplingParams
    score_only: bool = False    # max_new_tokens 0: the prompt's logprobs alone (one token is run and dropped)


@dataclasses.dataclass
class _Logprobs:
    """What a request asked of its logprobs (`return_logprob`)."""
    start: int              # logprob_start_len: prompt positions from here (-1: none)
    top: int                # top_logprobs_num
    with_text: bool         # return_text_in_logprobs


def _per_prompt(value, name: str, num_prompts: int, lists: bool = True) -> list:
    """A per-prompt field: one value for every prompt, or (with `lists`) a list with one per prompt."""
    if not (lists and isinstance(value, list)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise invalid(f"'{name}' has {len(value)} entries for {num_prompts} prompts", param=name)
    return value


def _inputs(f: Fields) -> tuple[list[str | list[int]], bool]:
    """The prompts (texts or token-id lists) and whether they came as a batch."""
    for name in NOT_SUPPORTED:
        if f.body.get(name) not in (None, False, [], {}):
            raise invalid(f"'{name}' is not supported", param=name)
    text, ids = f.body.get("text"), f.body.get("input_ids")
    if (text is None) == (ids is None):
        raise invalid("send exactly one of 'text' and 'input_ids'", param="text")
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return _checked_size(text, "text"), True
        raise invalid("'text' must be a string or a non-empty list of strings", param="text")
    if isinstance(ids, list) and ids and all(_is_id(t) for t in ids):
        return [ids], False
    if isinstance(ids, list) and ids and all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in ids):
        return _checked_size(ids, "input_ids"), True
    raise invalid("'input_ids' must be a non-empty list of token ids or a list of such lists", param="input_ids")


def _checked_size(prompts: list, name: str) -> list:
    if len(prompts) > MAX_BATCH:
        raise invalid(f"'{name}' holds {len(prompts)} prompts; at most {MAX_BATCH} are allowed", param=name)
    return prompts


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX


def _params(raw, state: ServerState, logprobs: _Logprobs | None) -> tuple[SamplingParams, bool]:
    """One prompt's SamplingParams from SGLang's `sampling_params` object, and whether it only scores the prompt
    (max_new_tokens 0: one token is run and dropped)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise invalid("'sampling_params' must be an object (or a list of one per prompt)", param="sampling_params")
    structured = [k for k in STRUCTURED if raw.get(k) is not None]
    if structured:
        raise invalid(f"structured outputs ('{structured[0]}') are not supported yet", param="sampling_params")
    unknown = sorted(k for k in raw if k not in RENAMED and k not in SAME_NAME
                     and k not in ("spaces_between_special_tokens", "custom_params", "stream_interval"))
    if unknown:
        raise invalid(f"unknown sampling parameters: {', '.join(unknown)}", param="sampling_params")
    if raw.get("spaces_between_special_tokens") is False:
        raise invalid("'spaces_between_special_tokens': false is not supported", param="sampling_params")
    if raw.get("custom_params") is not None:
        raise invalid("'custom_params' (custom logit processors) is not supported", param="sampling_params")
    f = Fields({RENAMED.get(k, k): v for k, v in raw.items()})
    try:
        max_new_tokens = f.int("max_tokens", DEFAULT_MAX_NEW_TOKENS, lo=0)
        params = sampling_params(
            f, n=f.int("n", 1, lo=1, hi=MAX_N), max_tokens=max(max_new_tokens, 1),
            max_model_len=state.max_model_len, model_defaults=state.model_defaults,
            logprobs=logprobs.top if logprobs else None,
            prompt_logprobs=logprobs.top if logprobs and logprobs.start >= 0 else None)
    except APIError as e:   # named as the client named them
        for theirs, ours in RENAMED.items():
            e.message = re.sub(rf"\b{ours}\b", theirs, e.message)
        raise invalid(e.message, param="sampling_params") from None
    return params, max_new_tokens == 0


def _logprob_options(f: Fields) -> _Logprobs | None:
    if not f.bool("return_logprob"):
        for name in ("top_logprobs_num", "logprob_start_len"):
            if f.body.get(name) not in (None, 0, -1):
                raise invalid(f"'{name}' needs 'return_logprob': true", param=name)
        return None
    return _Logprobs(start=f.int("logprob_start_len", -1, lo=-1, hi=INT32_MAX),
                     top=f.int("top_logprobs_num", 0, lo=0, hi=MAX_LOGPROBS),
                     with_text=f.bool("return_text_in_logprobs"))


async def _prompts(f: Fields, state: ServerState, logprobs: _Logprobs | None) -> tuple[list[_Prompt], bool]:
    inputs, batched = _inputs(f)
    raw_params = _per_prompt(f.body.get("sampling_params"), "sampling_params", len(inputs), lists=batched)
    rids = _per_prompt(f.body.get("rid"), "rid", len(inputs), lists=batched)
    if f.body.get("rid") is not None and not all(isinstance(r, str) and r for r in rids):
        raise invalid("'rid' must be a non-empty string (or one per prompt)", param="rid")
    prompts = []
    for i, prompt in enumerate(inputs):
        params, score_only = _params(raw_params[i], state, logprobs)
        ids = prompt if isinstance(prompt, list) else await state.encode(prompt)
        param = "input_ids" if isinstance(prompt, list) else "text"
        state.check_prompt(ids, params, param)
        if logprobs and logprobs.start >= len(ids):
            raise invalid(f"'logprob_start_len' ({logprobs.start}) must be below the prompt's {len(ids)} tokens",
                          param="logprob_start_len")
        prompts.append(_Prompt(rids[i] or uuid.uuid4().hex, ids, params, score_only))
    if len({p.rid for p in prompts}) != len(prompts):
        raise invalid("'rid' values must be distinct", param="rid")
    live = [p.rid for p in prompts if p.rid in state.generations]
    if live:
        raise invalid(f"the rid '{live[0]}' names a request still running", param="rid")
    return prompts, batched


class _Sequence:
    """One output sequence's state across the deltas, rendered in SGLang's shape."""

    def __init__(self, rid: str, index: int, prompt: _Prompt, state: ServerState, logprobs: _Logprobs | None,
                 with_prompt_ids: bool, start: float):
        self.rid, self.index, self.prompt, self.state, self.logprobs = rid, index, prompt, state, logprobs
        self.with_prompt_ids, self.start = with_prompt_ids, start
        self.completion = Completion()
        self.sent_tokens, self.sent_text = 0, 0     # what incremental streaming events have carried
        self._generated, self._generated_top = [], []   # rendered logprob triples, token by token
        self._prompt = self._prompt_top = None          # the prompt's, once they arrive

    def add(self, delta) -> None:
        if self.prompt.score_only:      # the token run for the prompt's logprobs is not an output
            delta = dataclasses.replace(delta, new_token_ids=[], new_text="", new_logprobs=[],
                                        finish_reason="length" if delta.finished else None)
        self.completion.add(delta)

    def end_aborted(self) -> bool:
        """Mark the sequence aborted if it had not finished (/abort_request); whether it had not."""
        if self.completion.finish_reason is not None:
            return False
        self.completion.finish_reason = "abort"
        return True

    def finish_reason(self) -> dict | None:
        c = self.completion
        if c.finish_reason is None:
            return None
        if c.finish_reason == "length":
            return {"type": "length", "length": len(c.token_ids)}
        if c.finish_reason == "abort":
            return {"type": "abort", "message": "the request was aborted"}
        matched = c.stop_reason if c.stop_reason is not None else (c.token_ids[-1] if c.token_ids else None)
        return {"type": "stop", "matched": matched}

    def render(self, with_index: bool, incremental: bool = False) -> dict:
        """The sequence in SGLang's shape: the whole answer so far, or (incremental streaming) what is new since
        the last event: text, ids and the generated tokens' logprobs."""
        c = self.completion
        meta = {"id": self.rid, "finish_reason": self.finish_reason(), "prompt_tokens": len(self.prompt.ids),
                "completion_tokens": len(c.token_ids), "cached_tokens": c.num_cached_tokens or 0,
                "weight_version": self.state.weight_version}
        if self.logprobs is not None:
            meta.update(self._logprobs())
        if c.finish_reason is not None:
            meta["e2e_latency"] = time.perf_counter() - self.start
        out = {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}
        if incremental:
            out["text"], out["output_ids"] = c.text[self.sent_text:], out["output_ids"][self.sent_tokens:]
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    meta[key] = meta[key][self.sent_tokens:]
            self.sent_tokens, self.sent_text = len(c.token_ids), len(c.text)
        if self.with_prompt_ids:
            out["prompt_token_ids"] = self.prompt.ids
        if with_index:
            out["index"] = self.index
        return out

    def _logprobs(self) -> dict:
        """The logprob fields, rendered once per token: a stream renders the sequence at every step."""
        c, options = self.completion, self.logprobs
        done = len(self._generated)
        for t, entry in zip(c.token_ids[done:], c.logprobs[done:]):
            self._generated.append(self._triple(t, entry.get(t)))
            if options.top > 0:
                self._generated_top.append(self._top(entry))
        if self._prompt is None and (options.start < 0 or c.prompt_logprobs is not None):
            entries = list(zip(self.prompt.ids, c.prompt_logprobs or []))[options.start:] if options.start >= 0 else []
            self._prompt = [self._triple(t, entry.get(t) if entry else None) for t, entry in entries]
            self._prompt_top = [self._top(entry) if entry else None for _, entry in entries]
        meta = {"output_token_logprobs": list(self._generated), "input_token_logprobs": list(self._prompt or [])}
        if options.top > 0:
            meta["output_top_logprobs"] = list(self._generated_top)
            meta["input_top_logprobs"] = list(self._prompt_top or [])
        return meta

    def _triple(self, token_id: int, lp: Logprob | None) -> list:
        text = None
        if self.logprobs.with_text:
            text = lp.decoded_token if lp is not None and lp.decoded_token is not None else self._decode(token_id)
        return [finite(lp.logprob) if lp is not None else None, token_id, text]

    def _top(self, entry: dict[int, Logprob]) -> list:
        return [self._triple(t, lp) for t, lp in ranked(entry, self.logprobs.top)]

    def _decode(self, token_id: int) -> str | None:
        tok = self.state.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else None


async def generate(request: Request):
    state = server_state(request)
    f = Fields(await read_json(request))
    logprobs = _logprob_options(f)
    prompts, batched = await _prompts(f, state, logprobs)
    loras = _loras(f, state, len(prompts))
    priority, stream = state.priority(f), f.bool("stream")
    start, salt = time.perf_counter(), state.cache_salt(f)
    # the engine's ids get a random suffix: a client may reuse a rid while its first use is still aborting
    jobs = [Job(f"{p.rid}-{uuid.uuid4().hex[:8]}", p.ids, p.params, priority=priority, lora_request=lora,
                cache_salt=salt, stop=asyncio.Event()) for p, lora in zip(prompts, loras)]
    with_prompt_ids = f.bool("return_prompt_token_ids")
    sequences, index = [], 0
    for p in prompts:
        sequences.append([])
        for i in range(p.params.n):
            rid = p.rid if p.params.n == 1 else f"{p.rid}-{i}"
            sequences[-1].append(_Sequence(rid, index, p, state, logprobs, with_prompt_ids, start))
            index += 1
    many = batched or index > 1
    stops = {p.rid: job.stop for p, job in zip(prompts, jobs)}
    state.generations.update(stops)          # /abort_request finds them from now until the stream is done
    deltas = _forgetting(stream_jobs(state.llm, jobs, state.metrics), state, stops)
    if stream:
        try:
            first = await first_delta(request, deltas)
        except StopAsyncIteration:     # aborted before its first token
            first = None
        return StreamingResponse(_events(first, deltas, sequences, many, state.incremental_streaming_output),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def drain():
        async with contextlib.aclosing(deltas):
            async for j, delta in deltas:
                sequences[j][delta.index].add(delta)
    try:
        await until_disconnect(request, drain())
    finally:
        _forget(state, stops)    # (also when drain never started)
    outputs = []
    for seq in (seq for per_prompt in sequences for seq in per_prompt):
        seq.end_aborted()
        outputs.append(seq.render(with_index=False))
    return JSONResponse(outputs if many else outputs[0])


async def _forgetting(deltas, state: ServerState, stops: dict[str, asyncio.Event]):
    """`deltas`, whose rids /abort_request forgets when the stream ends or is closed (by its consumer, or by the
    garbage collector when a streaming response never starts)."""
    try:
        async with contextlib.aclosing(deltas):
            async for item in deltas:
                yield item
    finally:
        _forget(state, stops)


def _forget(state: ServerState, stops: dict[str, asyncio.Event]) -> None:
    for rid, stop in stops.items():
        if state.generations.get(rid) is stop:
            del state.generations[rid]


async def _events(first, deltas, sequences, many, incremental):
    async with contextlib.aclosing(deltas):
        try:
            async for j, delta in (deltas if first is None else with_first(first, deltas)):
                seq = sequences[j][delta.index]
                seq.add(delta)
                if (delta.new_token_ids and not seq.prompt.score_only) or delta.finished:
                    yield sse(seq.render(many, incremental))
        except APIError as e:
            yield sse({"error": {"message": e.message, "code": e.status}})
            return
    for seq in (seq for per_prompt in sequences for seq in per_prompt):
        if seq.end_aborted():
            yield sse(seq.render(many, incremental))
    yield "data: [DONE]\n\n"


async def abort_request(request: Request) -> Response:
    """SGLang's POST /abort_request {"rid": ..., "abort_all": false}: the /generate prompts named (or all of them)
    end now, answering what they generated with finish_reason {"type": "abort"}. An unknown or finished rid is
    no error (it may have just finished)."""
    state = server_state(request)
    f = Fields(await read_json(request))
    if f.bool("abort_all"):
        stops = list(state.generations.values())
    else:
        rid = f.str("rid")
        if not rid:
            raise invalid("send 'rid' (a /generate request's id) or 'abort_all': true", param="rid")
        stops = [state.generations[rid]] if rid in state.generations else []
    for stop in stops:
        stop.set()
    return Response(status_code=200)


def _loras(f: Fields, state: ServerState, num_prompts: int) -> list:
    """SGLang's `lora_path`, one for all prompts or a list with one per prompt: the name of an adapter the server
    serves (`--lora-modules` or loaded at runtime), or null for the base model."""
    loras = []
    for name in _per_prompt(f.body.get("lora_path"), "lora_path", num_prompts):
        if name is not None and (not isinstance(name, str) or name not in state.lora_modules):
            served = ", ".join(sorted(state.lora_modules)) or "none"
            raise invalid(f"'lora_path' must name a loaded adapter (served: {served}), got {name!r}",
                          param="lora_path")
        loras.append(None if name is None else state.lora_modules[name])
    return loras


async def get_model_info(request: Request) -> JSONResponse:
    state = server_state(request)
    return JSONResponse({"model_path": state.model_name, "tokenizer_path": state.model_name,
                         "is_generation": True, "preferred_sampling_params": None,
                         "weight_version": state.weight_version, "max_model_len": state.max_model_len,
                         "served_model_names": list(state.model_names)})


async def get_server_info(request: Request) -> JSONResponse:
    """SGLang's /get_server_info (and its newer name /server_info): the settings a client sizes its work by, in
    SGLang's names, beside the engine's own."""
    from atlasjax import __version__
    state = server_state(request)
    config = state.llm.engine.config
    stats = state.llm.stats
    replicas = getattr(state.llm, "replicas", None)
    return JSONResponse({
        "model_path": config.model, "served_model_name": state.model_name, "version": __version__,
        "tp_size": config.tensor_parallel_size, "dp_size": len(replicas) if replicas else 1,
        "context_len": state.max_model_len, "max_running_requests": config.max_num_seqs,
        "chunked_prefill_size": config.max_num_batched_tokens, "max_prefill_tokens": config.max_num_batched_tokens,
        "max_total_num_tokens": stats.pages_total * config.page_size, "page_size": config.page_size,
        "kv_cache_dtype": config.kv_cache_dtype, "quantization": config.quantization,
        "enable_prefix_caching": config.enable_prefix_caching, "weight_version": state.weight_version})


async def flush_cache(request: Request) -> Response:
    """SGLang's /flush_cache: forget the prefix cache (vLLM's /reset_prefix_cache)."""
    server_state(request).llm.reset_prefix_cache()
    return Response("Cache flushed.\n", status_code=200)


async def health_generate(request: Request) -> Response:
    """SGLang's /health_generate: healthy (200) when the engine generates a token within HEALTH_GENERATE_TIMEOUT_S
    (a paused or asleep engine, or one that failed, is not: 503)."""
    state = server_state(request)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    async def one_token():
        stream = state.llm.generate([0], params, f"health-{uuid.uuid4().hex}")
        async with contextlib.aclosing(stream):
            async for _ in stream:
                pass
    try:
        await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        return JSONResponse({"status": "error", "error": f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s"},
                            status_code=503)
    except Exception as e:  # noqa: BLE001 (any failure is unhealthy)
        return JSONResponse({"status": "error", "error": str(e)}, status_code=503)
    return Response(status_code=200)


ROUTES = [
    Route("/generate", generate, methods=["POST"]),
    Route("/abort_request", abort_request, methods=["POST"]),
    Route("/get_model_info", get_model_info, methods=["GET"]),
    Route("/model_info", get_model_info, methods=["GET"]),
    Route("/get_server_info", get_server_info, methods=["GET"]),
    Route("/server_info", get_server_info, methods=["GET"]),
    Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    Route("/health_generate", health_generate, methods=["GET"]),
]

"""Embeddings and scores: POST /v1/embeddings (OpenAI's), POST /v1/score and /score (vLLM's, for embedding
models: the cosine similarity of two texts' embeddings), and POST /rerank, /v1/rerank, /v2/rerank (the
rerank API vLLM serves, Jina's and Cohere's shape: documents ordered by that similarity to a query), and
POST /classify (vLLM's, for a sequence classifier: labels and probabilities from its head). With a cross-encoder
(a classifier of one label, such as Qwen3-Reranker read through `--hf-overrides`: atlasjax/cross_encoder.py)
/score and /rerank score each (text_1, text_2) or (query, document) pair with its head instead.

Inputs are tokenized here and embedded by the engine between its steps (`LLMEngine.embed`,
atlasjax/embedding.py), pooled as the model says (atlasjax/pooling.py). /v1/embeddings takes OpenAI's
fields (`input`: a string, strings, token ids or lists of them; `encoding_format` float or base64;
`dimensions`), vLLM's extras (`truncate_prompt_tokens`, `add_special_tokens`, `normalize`) and, instead of
`input`, chat `messages` rendered with the model's template (vLLM's chat embeddings).
"""
from __future__ import annotations

import base64
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from atlasjax.cross_encoder import is_cross_encoder, pair_ids, pair_score
from atlasjax.errors import InvalidRequestError
from atlasjax.pooling import PoolingParams, class_probs
from atlasjax.sampling_params import check_truncate_prompt_tokens
from serving.bridge import until_disconnect
from serving.errors import engine_answer, invalid
from serving.protocol import Fields, chat_render_options, check_model, completion_prompts, text_content
from serving.state import ServerState, new_id, read_json, server_state

MAX_INPUTS = 2048          # OpenAI's limit on inputs per embeddings request
ENCODINGS = ("float", "base64")


async def embeddings(request: Request) -> JSONResponse:
    state = server_state(request)
    f = Fields(await read_json(request))
    model = check_model(f, state.model_names)
    encoding = f.str("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise invalid(f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got '{encoding}'",
                      param="encoding_format")
    f.str("user")
    params = _pooling_params(f)
    if f.body.get("messages") is not None:
        if f.body.get("input") is not None:
            raise invalid("send either 'input' or 'messages', not both", param="messages")
        options = chat_render_options(f)
        options["add_generation_prompt"] = f.bool("add_generation_prompt", False)
        ids = [await state.chat_prompt(_messages(f), **options)]
        param = "messages"
    else:
        prompts = completion_prompts(f, "input")
        if len(prompts) > MAX_INPUTS:
            raise invalid(f"'input' has {len(prompts)} entries; at most {MAX_INPUTS} are allowed", param="input")
        ids = await _token_ids(state, f, prompts)
        param = "input"
    _check_lengths(state, ids, params, param)
    rid, _ = new_id("embd-", request)
    results = await _embed(request, state, ids, params)
    data = [{"object": "embedding", "index": i, "embedding": _encode(vector, encoding)}
            for i, (_, vector) in enumerate(results)]
    tokens = sum(len(t) for t, _ in results)
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def score(request: Request) -> JSONResponse:
    """vLLM's score API for embedding models: `text_1` (one text, or a list) against `text_2` (a list, or one
    text); one score per pair: 1 -> N or N -> N."""
    state = server_state(request)
    f = Fields(await read_json(request))
    model = check_model(f, state.model_names)
    first, second = _texts(f, "text_1"), _texts(f, "text_2")
    if len(first) not in (1, len(second)):
        raise invalid(f"'text_1' has {len(first)} entries and 'text_2' {len(second)}: send one text_1 or as many "
                      "as text_2", param="text_1")
    if len(first) + len(second) > MAX_INPUTS:
        raise invalid(f"at most {MAX_INPUTS} texts in all", param="text_2")
    rid, _ = new_id("score-", request)
    if is_cross_encoder(state.llm.engine.classifier_labels):
        scores, tokens = await _cross_scores(request, state, f, first * (len(second) // len(first)), second, "text_1")
    else:
        params = PoolingParams(normalize=True, truncate_prompt_tokens=_truncation(f))
        ids = await _token_ids(state, f, first + second)
        _check_lengths(state, ids, params, "text_1")
        results = await _embed(request, state, ids, params)
        left, right = results[:len(first)] * (len(second) // len(first)), results[len(first):]
        scores = [float(a @ b) for (_, a), (_, b) in zip(left, right)]
        tokens = sum(len(t) for t, _ in results)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank(request: Request) -> JSONResponse:
    """The rerank API vLLM serves (Jina's and Cohere's shape) for embedding models: `documents` ordered by the
    cosine similarity of their embedding to the `query`'s, the best `top_n` (default: all)."""
    state = server_state(request)
    f = Fields(await read_json(request))
    model = check_model(f, state.model_names)
    query = f.body.get("query")
    if not isinstance(query, str) or not query:
        raise invalid("'query' must be a non-empty string", param="query")
    documents = f.body.get("documents")
    texts = [d.get("text") if isinstance(d, dict) else d for d in documents] if isinstance(documents, list) else None
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise invalid("'documents' must be a non-empty list of non-empty strings (or {\"text\": ...} objects)",
                      param="documents")
    if len(texts) + 1 > MAX_INPUTS:
        raise invalid(f"at most {MAX_INPUTS - 1} documents", param="documents")
    top_n = f.int("top_n", len(texts), lo=1)
    return_documents = f.bool("return_documents", True)
    rid, _ = new_id("rerank-", request)
    if is_cross_encoder(state.llm.engine.classifier_labels):
        scores, tokens = await _cross_scores(request, state, f, [query] * len(texts), texts, "documents")
    else:
        params = PoolingParams(normalize=True, truncate_prompt_tokens=_truncation(f))
        ids = await _token_ids(state, f, [query, *texts])
        _check_lengths(state, ids, params, "documents")
        results = await _embed(request, state, ids, params)
        scores = [float(results[0][1] @ v) for _, v in results[1:]]
        tokens = sum(len(t) for t, _ in results)
    scored = sorted(((s, i) for i, s in enumerate(scores)), key=lambda x: -x[0])[:top_n]
    out = [{"index": i, "relevance_score": score, **({"document": {"text": texts[i]}} if return_documents else {})}
           for score, i in scored]
    return JSONResponse({"id": rid, "model": model, "results": out, "usage": {"total_tokens": tokens}})


async def classify(request: Request) -> JSONResponse:
    """vLLM's /classify, for a *ForSequenceClassification checkpoint (classifiers, reward models): per input
    its label, the probabilities (softmax; a sigmoid for one label) and, atlasjax's addition, the raw logits."""
    state = server_state(request)
    f = Fields(await read_json(request))
    model = check_model(f, state.model_names)
    prompts = completion_prompts(f, "input")
    if len(prompts) > MAX_INPUTS:
        raise invalid(f"'input' has {len(prompts)} entries; at most {MAX_INPUTS} are allowed", param="input")
    params = PoolingParams(task="classify", truncate_prompt_tokens=_truncation(f))
    ids = await _token_ids(state, f, prompts)
    _check_lengths(state, ids, params, "input")
    rid, _ = new_id("classify-", request)
    results = await _embed(request, state, ids, params)
    labels = state.llm.engine.classifier_labels
    data = []
    for i, (_, logits) in enumerate(results):
        probs = class_probs(logits)
        best = int(np.argmax(probs))        # (a single-label head: its label, as vLLM answers)
        data.append({"index": i, "label": labels[best] if best < len(labels) else None, "probs": probs.tolist(),
                     "logits": logits.tolist(), "num_classes": len(probs)})
    tokens = sum(len(t) for t, _ in results)
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _cross_scores(request: Request, state: ServerState, f: Fields, firsts: list, seconds: list,
                        param: str) -> tuple[list[float], int]:
    """A cross-encoder's score per (first, second) pair (atlasjax/cross_encoder.py): the sigmoid of its one-label
    head over the pair's tokens (the second text's without special tokens), and the tokens run."""
    params = PoolingParams(task="classify", truncate_prompt_tokens=_truncation(f))
    lefts = await _token_ids(state, f, firsts)
    rights = [t if isinstance(t, list) else await state.encode(t, False) for t in seconds]
    ids = [pair_ids(a, b) for a, b in zip(lefts, rights)]
    _check_lengths(state, ids, params, param)
    results = await _embed(request, state, ids, params)
    return [pair_score(logits) for _, logits in results], sum(len(t) for t, _ in results)


async def _token_ids(state: ServerState, f: Fields, prompts: list) -> list[list[int]]:
    """Texts tokenized (with special tokens unless `add_special_tokens: false`); token-id inputs as they are."""
    add_special = f.bool("add_special_tokens", True)
    return [p if isinstance(p, list) else await state.encode(p, add_special) for p in prompts]


def _truncation(f: Fields) -> int | None:
    try:
        return check_truncate_prompt_tokens(f.int("truncate_prompt_tokens", None))
    except InvalidRequestError as e:
        raise invalid(str(e), param="truncate_prompt_tokens") from None


def _pooling_params(f: Fields) -> PoolingParams:
    dimensions = f.int("dimensions", None, lo=1)
    truncate = _truncation(f)
    return PoolingParams(dimensions=dimensions, normalize=f.bool("normalize", None), truncate_prompt_tokens=truncate)


def _messages(f: Fields) -> list[dict]:
    messages = f.body["messages"]
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise invalid("'messages' must be a non-empty list of objects", param="messages")
    return [{"role": m.get("role"), "content": text_content(m.get("content"), f"messages[{i}].content")}
            for i, m in enumerate(messages)]


def _texts(f: Fields, name: str) -> list[str | list[int]]:
    if f.body.get(name) is None:
        raise invalid(f"'{name}' is required", param=name)
    return completion_prompts(f, name)


def _check_lengths(state: ServerState, ids: list[list[int]], params: PoolingParams, param: str) -> None:
    """Empty and over-long inputs, answered before anything reaches the engine (the engine checks again)."""
    limit = state.max_model_len
    for i, t in enumerate(ids):
        if not t:
            raise invalid(f"{param} {i} is empty (no tokens)", param=param)
        if max(t) >= state.vocab_size:
            raise invalid(f"token ids must be in [0, {state.vocab_size})", param=param)
        if params.truncate_prompt_tokens is None and len(t) > limit:
            raise invalid(f"{param} {i} has {len(t)} tokens; max_model_len={limit} (truncate_prompt_tokens keeps "
                          "the last N)", param=param, code="context_length_exceeded")


async def _embed(request: Request, state: ServerState, ids: list[list[int]], params: PoolingParams) -> list:
    start = time.monotonic()
    results = await engine_answer(until_disconnect(request, state.llm.embed(ids, params)))
    state.metrics.observe_embedding(time.monotonic() - start)
    return results


def _encode(vector: np.ndarray, encoding: str):
    if encoding == "base64":    # little-endian float32, as OpenAI sends it
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


ROUTES = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/score", score, methods=["POST"]),
    Route("/score", score, methods=["POST"]),
    Route("/rerank", rerank, methods=["POST"]),
    Route("/v1/rerank", rerank, methods=["POST"]),
    Route("/v2/rerank", rerank, methods=["POST"]),
    Route("/classify", classify, methods=["POST"]),
]

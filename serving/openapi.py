"""The OpenAPI 3.1 description served at /openapi.json, written by hand from one table.

Request bodies list the fields the server reads (protocol.py validates them); responses name
the success shape and the error statuses a client should expect.
"""
from __future__ import annotations

from atlasjax import __version__

STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
STOP = {"oneOf": [STR, {"type": "array", "items": STR}]}
TEXT_OR_PARTS = {"oneOf": [STR, {"type": "array", "items": {"type": "object", "properties": {
    "type": {"const": "text"}, "text": STR}}}]}
SAMPLING = {"temperature": NUM, "top_p": NUM, "top_k": INT, "min_p": NUM, "presence_penalty": NUM,
            "frequency_penalty": NUM, "repetition_penalty": NUM, "seed": INT, "stop": STOP, "n": INT,
            "min_tokens": INT, "ignore_eos": BOOL, "stop_token_ids": {"type": "array", "items": INT},
            "logit_bias": {"type": "object", "additionalProperties": NUM},
            "allowed_token_ids": {"type": "array", "items": INT}, "truncate_prompt_tokens": INT,
            "bad_words": {"type": "array", "items": STR},
            "stream": BOOL, "stream_options": {"type": "object", "properties": {"include_usage": BOOL}},
            "priority": INT, "use_beam_search": BOOL, "length_penalty": NUM, "cache_salt": STR}
PROMPT = {"oneOf": [STR, {"type": "array", "items": STR}, {"type": "array", "items": INT},
                    {"type": "array", "items": {"type": "array", "items": INT}}]}
MESSAGE = {"type": "object", "required": ["role", "content"],
           "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]}, "content": TEXT_OR_PARTS}}


def _obj(required: list[str], **properties) -> dict:
    return {"type": "object", "required": required, "properties": properties}


SCHEMAS = {
    "CompletionRequest": _obj(["prompt"], model=STR, prompt=PROMPT, max_tokens=INT, logprobs=INT, echo=BOOL,
        prompt_logprobs=INT, return_tokens_as_token_ids=BOOL, return_token_ids=BOOL, **SAMPLING),
    "ChatCompletionRequest": _obj(["messages"], model=STR, messages={"type": "array", "items": MESSAGE},
                                  max_tokens=INT, max_completion_tokens=INT, logprobs=BOOL, top_logprobs=INT,
                                  return_tokens_as_token_ids=BOOL, return_token_ids=BOOL, prompt_logprobs=INT,
                                  response_format={"type": "object", "properties": {"type": {"const": "text"}}},
                                  chat_template_kwargs={"type": "object"}, thinking_token_budget=INT, **SAMPLING),
    "MessagesRequest": _obj(["messages", "max_tokens"], model=STR, system=TEXT_OR_PARTS, max_tokens=INT,
                            messages={"type": "array", "items": _obj(["role", "content"], role={
                                "enum": ["user", "assistant"]}, content=TEXT_OR_PARTS)},
                            stop_sequences={"type": "array", "items": STR}, temperature=NUM, top_p=NUM, top_k=INT,
                            stream=BOOL, priority=INT,
                            thinking=_obj(["type"], type={"enum": ["enabled", "adaptive", "disabled"]},
                                          budget_tokens=INT)),
    "ResponseRequest": _obj(["input"], model=STR, input={"oneOf": [STR, {"type": "array", "items": _obj(
        ["role", "content"], type={"const": "message"}, role={"enum": ["system", "developer", "user", "assistant"]},
        content={"oneOf": [STR, {"type": "array", "items": _obj(["type", "text"], type={
            "enum": ["input_text", "output_text", "text"]}, text=STR)}]})}]}, instructions=STR,
        previous_response_id=STR, store=BOOL, max_output_tokens=INT, truncation={"enum": ["disabled", "auto"]},
        include={"type": "array", "items": {"const": "message.output_text.logprobs"}}, top_logprobs=INT,
        metadata={"type": "object", "additionalProperties": STR}, reasoning={"type": "object"},
        text={"type": "object", "properties": {"format": {"type": "object", "properties": {
            "type": {"const": "text"}}}}},
        chat_template_kwargs={"type": "object"}, **SAMPLING),
    "EmbeddingRequest": _obj([], model=STR, input=PROMPT, messages={"type": "array", "items": MESSAGE},
                             encoding_format={"enum": ["float", "base64"]}, dimensions=INT, user=STR,
                             truncate_prompt_tokens=INT, add_special_tokens=BOOL, normalize=BOOL,
                             add_generation_prompt=BOOL, chat_template_kwargs={"type": "object"}),
    "ScoreRequest": _obj(["text_1", "text_2"], model=STR, text_1=PROMPT, text_2=PROMPT, truncate_prompt_tokens=INT,
                         add_special_tokens=BOOL),
    "RerankRequest": _obj(["query", "documents"], model=STR, query=STR, documents={"type": "array", "items": {
        "oneOf": [STR, _obj(["text"], text=STR)]}}, top_n=INT, return_documents=BOOL, truncate_prompt_tokens=INT),
    "ClassifyRequest": _obj(["input"], model=STR, input=PROMPT, truncate_prompt_tokens=INT, add_special_tokens=BOOL),
    "TokenizeRequest": _obj([], model=STR, prompt=STR, messages={"type": "array", "items": MESSAGE},
                            add_special_tokens=BOOL, chat_template_kwargs={"type": "object"}),
    "DetokenizeRequest": _obj(["tokens"], model=STR, tokens={"type": "array", "items": INT}),
    "GenerateRequest": _obj([], text={"oneOf": [STR, {"type": "array", "items": STR}]},
                            input_ids={"oneOf": [{"type": "array", "items": INT},
                                                 {"type": "array", "items": {"type": "array", "items": INT}}]},
                            sampling_params={"oneOf": [{"type": "object"}, {"type": "array", "items": {
                                "type": "object"}}]},
                            stream=BOOL, rid={"oneOf": [STR, {"type": "array", "items": STR}]}, lora_path=STR,
                            return_logprob=BOOL, logprob_start_len=INT, top_logprobs_num=INT,
                            return_text_in_logprobs=BOOL, return_prompt_token_ids=BOOL, priority=INT,
                            cache_salt=STR),
    "Error": _obj(["error"], error=_obj(["message", "type"], message=STR, type=STR, param=STR, code=STR)),
}

# (path, method) -> (summary, request schema or None, streams SSE?)
OPERATIONS = {
    ("/v1/models", "get"): ("List the served model", None, False),
    ("/v1/models/{model}", "get"): ("Describe the served model", None, False),
    ("/v1/completions", "post"): ("OpenAI text completion", "CompletionRequest", True),
    ("/v1/chat/completions", "post"): ("OpenAI chat completion", "ChatCompletionRequest", True),
    ("/v1/responses", "post"): ("OpenAI Responses API (text; stored for GET and previous_response_id)",
                                "ResponseRequest", True),
    ("/v1/responses/{response_id}", "get"): ("A stored response", None, False),
    ("/v1/responses/{response_id}", "delete"): ("Delete a stored response", None, False),
    ("/v1/responses/{response_id}/input_items", "get"): ("A stored response's input items (paginated: order, after, "
                                                         "limit)", None, False),
    ("/v1/messages", "post"): ("Anthropic Messages API", "MessagesRequest", True),
    ("/v1/messages/count_tokens", "post"): ("Anthropic token count of a Messages request", "MessagesRequest",
                                            False),
    ("/v1/embeddings", "post"): ("OpenAI embeddings (pooled final hidden states; input or chat messages)",
                                 "EmbeddingRequest", False),
    ("/v1/score", "post"): ("vLLM's score for embedding models: cosine similarity of text_1 and text_2",
                            "ScoreRequest", False),
    ("/score", "post"): ("The same as /v1/score", "ScoreRequest", False),
    ("/rerank", "post"): ("Rerank documents by their embeddings' cosine similarity to a query (Jina / Cohere "
                          "shape, as vLLM serves it)", "RerankRequest", False),
    ("/v1/rerank", "post"): ("The same as /rerank", "RerankRequest", False),
    ("/v2/rerank", "post"): ("The same as /rerank", "RerankRequest", False),
    ("/classify", "post"): ("vLLM's classification by a *ForSequenceClassification model's head: label, probs, "
                            "logits per input", "ClassifyRequest", False),
    ("/tokenize", "post"): ("Text or chat messages to token ids", "TokenizeRequest", False),
    ("/detokenize", "post"): ("Token ids to text", "DetokenizeRequest", False),
    ("/health", "get"): ("Liveness and engine occupancy (no API key needed)", None, False),
    ("/ping", "get"): ("Liveness as /health's status code, no body (SageMaker's probe; no API key needed)", None,
                       False),
    ("/ping", "post"): ("The same as GET /ping (SageMaker sends either)", None, False),
    ("/load", "get"): ("vLLM's: {\"server_load\": HTTP requests in progress, probes aside} (no API key needed)", None,
                       False),
    ("/version", "get"): ("The engine's version (no API key needed)", None, False),
    ("/reset_prefix_cache", "post"): ("Forget the cached prompt pages no running request holds (vLLM's)", None,
                                      False),
    ("/metrics", "get"): ("Prometheus metrics (text exposition format)", None, False),
    ("/sleep", "post"): ("With --enable-sleep-mode: release the idle engine's device memory (?level=1: weights "
                         "to host memory, 2: discarded; the KV pool dropped)", None, False),
    ("/wake_up", "post"): ("With --enable-sleep-mode: take back what /sleep released (?tags=weights&tags=kv_cache)",
                           None, False),
    ("/release_memory_occupation", "post"): ("With --enable-sleep-mode: SGLang's, as /sleep?level=1 ({\"tags\"}: "
                                             "weights and kv_cache together)", None, False),
    ("/resume_memory_occupation", "post"): ("With --enable-sleep-mode: SGLang's, as /wake_up ({\"tags\"})", None,
                                            False),
    ("/is_sleeping", "get"): ("With --enable-sleep-mode: {\"is_sleeping\": bool}", None, False),
    ("/invocations", "post"): ("SageMaker's route (vLLM's): a chat, completion, embedding, rerank or score request, "
                               "by its body's fields (messages / prompt / input / documents / text_1)", None, False),
    ("/start_profile", "post"): ("With --profiler-dir: trace the engine from now (jax.profiler; vLLM's)", None, False),
    ("/stop_profile", "post"): ("With --profiler-dir: end the trace and write it ({\"directory\"})", None, False),
    ("/v1/load_lora_adapter", "post"): ("With --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=true: serve a LoRA "
                                        "adapter ({\"lora_name\", \"lora_path\"}; vLLM's)", None, False),
    ("/v1/unload_lora_adapter", "post"): ("With --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=true: stop serving "
                                          "a LoRA adapter ({\"lora_name\"})", None, False),
    ("/pause", "post"): ("With --enable-weight-updates: pause generation (?mode=abort|wait|keep&clear_cache=true|"
                         "false; vLLM's); answered once it has taken effect", None, False),
    ("/resume", "post"): ("With --enable-weight-updates: resume generation (vLLM's)", None, False),
    ("/is_paused", "get"): ("With --enable-weight-updates: {\"is_paused\": bool}", None, False),
    ("/pause_generation", "post"): ("With --enable-weight-updates: SGLang's pause ({\"mode\": \"abort\" | "
                                    "\"retract\" | \"in_place\"})", None, False),
    ("/continue_generation", "post"): ("With --enable-weight-updates: SGLang's resume", None, False),
    ("/update_weights_from_disk", "post"): ("With --enable-weight-updates: load a checkpoint of the same architecture "
                                            "in place of the weights ({\"model_path\", \"abort_all_requests\", "
                                            "\"weight_version\"}; SGLang's)", None, False),
    ("/get_weight_version", "get"): ("With --enable-weight-updates: {\"weight_version\"} (SGLang's)", None, False),
    ("/generate", "post"): ("SGLang's native generation: text or token ids in, text, output_ids and meta_info out "
                            "(no chat template)", "GenerateRequest", True),
    ("/abort_request", "post"): ("SGLang's: end /generate prompts now ({\"rid\"} or {\"abort_all\": true}); they "
                                 "answer what they generated, finish_reason abort", None, False),
    ("/get_model_info", "get"): ("SGLang's model info ({\"model_path\", \"weight_version\", ...})", None, False),
    ("/model_info", "get"): ("The same as /get_model_info (SGLang's newer name)", None, False),
    ("/get_server_info", "get"): ("SGLang's server info: context_len, max_running_requests, max_total_num_tokens, "
                                  "tp_size, dp_size, ...", None, False),
    ("/server_info", "get"): ("The same as /get_server_info (SGLang's newer name)", None, False),
    ("/flush_cache", "get"): ("SGLang's: forget the prefix cache (as /reset_prefix_cache)", None, False),
    ("/flush_cache", "post"): ("The same as GET /flush_cache", None, False),
    ("/health_generate", "get"): ("SGLang's: healthy (200) when the engine generates a token, else 503", None, False),
    ("/openapi.json", "get"): ("This document", None, False),
}
ERRORS = {"400": "Invalid request", "401": "Missing or wrong API key", "413": "Request body too large",
          "503": "Queue full; retry after the Retry-After header's seconds"}


def _operation(summary: str, schema: str | None, streams: bool) -> dict:
    content = {"application/json": {}}
    if streams:
        content["text/event-stream"] = {}
    op = {"summary": summary, "responses": {"200": {"description": "Success", "content": content}}}
    if schema is not None:
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}
        err = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
        op["responses"].update({code: {"description": text, "content": err} for code, text in ERRORS.items()})
    return op


def openapi_schema() -> dict:
    paths: dict[str, dict] = {}
    for (path, method), (summary, schema, streams) in OPERATIONS.items():
        paths.setdefault(path, {})[method] = _operation(summary, schema, streams)
    return {"openapi": "3.1.0",
            "info": {"title": "atlasjax", "version": __version__,
                     "description": "OpenAI- and Anthropic-compatible inference server"},
            "components": {"schemas": SCHEMAS,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                               "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
            "security": [{"bearer": []}, {"apiKey": []}],
            "paths": paths}

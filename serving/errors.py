"""HTTP errors: one exception type, rendered in the OpenAI or the Anthropic error shape.

Handlers raise `APIError(status, message, param=...)`; engine exceptions are mapped by
`from_engine_error`. The shape follows the route: `/v1/messages...` gets Anthropic's
`{"type": "error", "error": {"type", "message"}}`, everything else OpenAI's
`{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations


from starlette.responses import JSONResponse

from atlasjax.errors import AtlasJaxError, InvalidRequestError, QueueFullError

# status -> (OpenAI error type, Anthropic error type)
ERROR_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("server_error", "api_error"),
    503: ("server_overloaded", "overloaded_error"),
}
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(err: APIError, path: str) -> dict:
    openai_type, anthropic_type = ERROR_TYPES.get(err.status, ERROR_TYPES[500])
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": anthropic_type, "message": err.message}}
    return {"error": {"message": err.message, "type": openai_type, "param": err.param, "code": err.code}}


def error_response(err: APIError, path: str) -> JSONResponse:
    return JSONResponse(error_body(err, path), status_code=err.status, headers=err.headers)


async def engine_answer(call):
    """Await a one-shot engine command (an embedding, sleep, wake_up): what the engine refuses, or an
    engine-side failure, becomes the HTTP error from_engine_error names."""
    try:
        return await call
    except (AtlasJaxError, RuntimeError) as e:
        raise from_engine_error(e) from None


def from_engine_error(exc: BaseException) -> APIError:
    """Map an exception raised by AsyncLLM.generate to the HTTP error the client sees."""
    if isinstance(exc, QueueFullError):
        return APIError(503, f"the server is busy ({exc}); retry later", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, InvalidRequestError):
        return invalid(str(exc))
    if isinstance(exc, AtlasJaxError):
        return invalid(str(exc))
    return APIError(500, f"internal error: {exc}", code="engine_error")

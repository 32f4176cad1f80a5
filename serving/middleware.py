"""Pure-ASGI middleware: request ids, request counting, API-key check, request-body size limit.

Order (outermost first, see app.py): CORS (optional) -> RequestId -> RequestMetrics -> ApiKey ->
BodyLimit -> router. Rejections here are sent directly in the error shape of the route's API, since they
happen outside the router's exception handlers.
"""
from __future__ import annotations

import hmac
import uuid

from serving.errors import APIError, error_response


MAX_REQUEST_ID_CHARS = 128


def client_request_id(headers: dict[bytes, bytes]) -> str | None:
    """The client's `X-Request-Id`, if it is usable as an id: 1-128 printable ASCII characters, no spaces."""
    raw = headers.get(b"x-request-id")
    if raw is None or not 0 < len(raw) <= MAX_REQUEST_ID_CHARS or not all(0x21 <= c <= 0x7E for c in raw):
        return None
    return raw.decode("ascii")


class RequestIdMiddleware:
    """Every response carries `X-Request-Id`: the client's own (vLLM's behavior, for tracing through
    proxies), or a fresh one. Routes read it as `request.state.request_id` (None: the client sent none)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = client_request_id(dict(scope["headers"]))
        scope.setdefault("state", {})["request_id"] = given
        header = (given or uuid.uuid4().hex).encode("ascii")

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", header)]}
            await send(message)
        return await self.app(scope, receive, send_wrapper)


UNLOADED_PATHS = frozenset({"/load", "/health", "/ping", "/metrics", "/version"})   # probes: not server load


class RequestMetricsMiddleware:
    """Counts every HTTP response by endpoint (unknown paths pooled as "other") and status, and the requests in
    progress other than probes (`metrics.server_load`, vLLM's /load)."""

    def __init__(self, app, metrics, known_paths: set[str]):
        self.app, self.metrics, self.known_paths = app, metrics, known_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope["path"]
        load = path not in UNLOADED_PATHS
        self.metrics.server_load += load
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.server_load -= load
            self.metrics.observe_request(path if path in self.known_paths else "other", status)


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer KEY` or `x-api-key: KEY` everywhere but open paths."""

    def __init__(self, app, api_key: str, open_paths: set[str]):
        self.app, self.api_key, self.open_paths = app, api_key.encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if given is None or not hmac.compare_digest(given, self.api_key):
            message = "missing API key" if given is None else "invalid API key"
            err = APIError(401, f"{message}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await error_response(err, scope["path"])(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over max_bytes: by Content-Length up front, else while the body streams in."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {self.max_bytes} bytes",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                err = APIError(400, "invalid Content-Length header")
                return await error_response(err, scope["path"])(scope, receive, send)
            if int(length) > self.max_bytes:
                return await error_response(self._too_large(), scope["path"])(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()     # raised inside the handler's body read: a 413 response
            return message

        return await self.app(scope, limited_receive, send)

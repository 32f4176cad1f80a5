"""Pure-ASGI middleware: request counting, API-key check, request-body size limit.

Order (outermost first, see app.py): CORS (optional) -> RequestMetrics -> ApiKey -> BodyLimit
-> router. Rejections here are sent directly in the error shape of the route's API, since they
happen outside the router's exception handlers.
"""
from __future__ import annotations

import hmac

from serving.errors import APIError, error_response


class RequestMetricsMiddleware:
    """Counts every HTTP response by endpoint (unknown paths pooled as "other") and status."""

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
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
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

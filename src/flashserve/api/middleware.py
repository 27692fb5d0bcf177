"""The guard in front of every route: API key, body size, draining; counts requests in flight.
Around it, the request id: the client's `x-request-id` or a fresh one, on every response.

Pure ASGI middlewares rather than Starlette's BaseHTTPMiddleware, which would buffer streamed
responses and hide the client's disconnect from the handlers that watch `receive()`.
"""

from __future__ import annotations

import hmac
import json
import uuid
from typing import Any, Awaitable, Callable, MutableMapping

from starlette.exceptions import HTTPException as StarletteHTTPException

from flashserve.api.errors import AUTHENTICATION, APIError, overloaded
from flashserve.api.options import OPEN_PATHS, OPEN_PREFIX, APIOptions, ServerState
from flashserve.metrics import Metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
               "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG_KEY = "Incorrect API key provided."

REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_LENGTH = 256


class RequestIdMiddleware:
    """Names each HTTP request: `scope["state"]["request_id"]` (`request.state.request_id` in a
    handler) and an `x-request-id` header on its response, so a client can quote it and find the
    request's log line. Meant to wrap everything else, Starlette's error middleware included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _client_request_id(scope) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        value = request_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _client_request_id(scope: Scope) -> str | None:
    """The client's id if it is short visible ASCII. No spaces: it goes into a space-separated
    log line, where a space would let a client write fields of its own."""
    raw = _header(scope, REQUEST_ID_HEADER)
    if raw is None or not 0 < len(raw) <= MAX_REQUEST_ID_LENGTH:
        return None
    if any(not 0x21 <= byte <= 0x7E for byte in raw):
        return None
    return raw.decode("ascii")


class GuardMiddleware:
    def __init__(self, app: ASGIApp, options: APIOptions, state: ServerState, metrics: Metrics) -> None:
        self.app = app
        self.keys = [key.encode() for key in options.api_keys]
        self.max_body_bytes = options.max_body_bytes
        self.state = state
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["path"].startswith(OPEN_PREFIX):
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await self._reject(refusal, send)
            return
        self.state.enter()
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            self.state.leave()

    def _refusal(self, scope: Scope) -> APIError | None:
        if self.keys:
            auth = _header(scope, b"authorization")
            if auth is not None and auth.lower().startswith(b"bearer "):
                given: bytes | None = auth[len(b"bearer "):].strip()
            else:
                given = _header(scope, b"x-api-key")  # how Anthropic's clients send the key
            if given is None:
                return APIError(401, MISSING_KEY, AUTHENTICATION, headers={"WWW-Authenticate": "Bearer"})
            # Compare with every key, so the time taken says nothing about which one nearly matched.
            matches = [hmac.compare_digest(given, key) for key in self.keys]
            if not any(matches):
                return APIError(401, WRONG_KEY, AUTHENTICATION, code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        if self.state.draining:
            return overloaded("the server is shutting down", code="shutting_down")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return _too_large(self.max_body_bytes)
        return None

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that fails a body growing past the limit (chunked uploads send no length)."""
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    # Raised inside FastAPI's body read, which passes HTTPException through.
                    raise StarletteHTTPException(413, _too_large(self.max_body_bytes).message)
            return message

        return limited

    async def _reject(self, err: APIError, send: Send) -> None:
        self.metrics.record_error(err.type, err.code)
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
        # The request body may be unread: close the connection rather than parse what follows.
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes.", code="request_too_large")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None

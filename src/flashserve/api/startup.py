"""The front end's answer while the model loads: the port listens from the start, and a probe or a
router should hear "starting" at once rather than wait on a connection nobody serves.

`StartupGate` is the ASGI app uvicorn serves from the moment the front end starts. Until `open` is
called with the OpenAI app it answers every request itself: `/health` with 503 and
`{"status": "starting", "reason": ...}`, anything else with 503 in OpenAI's error shape (code
`starting`, a Retry-After header). From `open` on, every request goes to the app. Plain ASGI and
the standard library only: it must serve before the app's imports (FastAPI, transformers) finish.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

LOADING_MODEL = "loading model"
# What a client told "starting" should wait before it retries, in seconds: loading takes a while.
STARTING_RETRY_AFTER_SECONDS = 5


class StartupGate:
    def __init__(self, reason: str = LOADING_MODEL) -> None:
        self.reason = reason
        self.app: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None

    def open(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        """From now on every request goes to `app`."""
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._refuse(scope, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1013})  # try again later
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        headers = [(b"content-type", b"application/json")]
        if scope["path"] == "/health":
            body: dict[str, Any] = {"status": "starting", "reason": self.reason}
        else:
            message = f"the server is starting ({self.reason}); retry later"
            body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": "starting"}}
            headers.append((b"retry-after", str(STARTING_RETRY_AFTER_SECONDS).encode()))
        data = json.dumps(body).encode()
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": data})


async def _lifespan(receive: Receive, send: Send) -> None:
    """Nothing to start or stop: the OpenAI app needs no lifespan events."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return

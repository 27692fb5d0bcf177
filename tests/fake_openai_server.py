"""An OpenAI-compatible streaming server with known timing, for testing the benchmark client.

Each request streams `max_tokens` (or `num_tokens`) one-word chunks: the first `ttft_s` after the
request's prefill, then one every `itl_s`; then a usage chunk and `data: [DONE]`. With `prefill_s`,
requests take an exclusive `prefill_s` turn before their first token (one at a time, in arrival
order), so TTFT rises with load once arrivals come faster than 1 / prefill_s. `mode` injects faults:
`malformed`, `error_event`, `http_500`, `no_done`, `drop` (connection cut mid-stream), `no_usage`.
Runs uvicorn in a background thread on a free 127.0.0.1 port.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "fake-model"


@dataclass
class FakeConfig:
    ttft_s: float = 0.05  # after the prefill turn
    itl_s: float = 0.01
    num_tokens: int | None = None  # None: max_tokens
    prefill_s: float = 0.0
    mode: str = "ok"
    fault_at: int = 2  # token index at which a fault is injected


class FakeServer:
    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._prefill_lock: asyncio.Lock | None = None
        self.base_url = ""

    def reset(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.in_flight = self.max_in_flight = self.requests = 0

    def start(self) -> str:
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without
        # it Nagle + delayed ACK add ~40 ms to every request on a reused connection.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="critical", lifespan="off", loop="asyncio")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{port}"
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await self._handle(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await self._handle(await request.json(), chat=True)

        return app

    async def _handle(self, body: dict[str, Any], chat: bool) -> Any:
        self.requests += 1
        if self.config.mode == "http_500":
            return JSONResponse({"error": {"message": "boom", "type": "internal_error"}}, status_code=500)
        if chat:
            prompt_tokens = sum(len(str(m["content"]).split()) for m in body["messages"])
        else:
            p = body["prompt"]
            prompt_tokens = len(p) if isinstance(p, list) else len(str(p).split())
        return StreamingResponse(self._stream(body, chat, prompt_tokens), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], chat: bool, prompt_tokens: int) -> AsyncIterator[str]:
        cfg = self.config
        loop = asyncio.get_running_loop()
        n = cfg.num_tokens or int(body["max_tokens"])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if chat:  # servers send the role first, without content: not a token
                yield _sse(_chunk(chat, None, role=True))
            if cfg.prefill_s:
                if self._prefill_lock is None:
                    self._prefill_lock = asyncio.Lock()
                async with self._prefill_lock:
                    await asyncio.sleep(cfg.prefill_s)
            first = loop.time() + cfg.ttft_s
            for i in range(n):
                delay = first + i * cfg.itl_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if i == cfg.fault_at:
                    if cfg.mode == "malformed":
                        yield "data: {not json\n\n"
                    elif cfg.mode == "error_event":
                        yield _sse({"error": {"message": "engine died", "type": "internal_error"}})
                        yield "data: [DONE]\n\n"
                        return
                    elif cfg.mode == "drop":
                        raise RuntimeError("connection cut on purpose")
                yield _sse(_chunk(chat, f" w{i}"))
            if cfg.mode != "no_usage":
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                yield _sse({"id": "x", "object": "chunk", "model": MODEL_ID, "choices": [], "usage": usage})
            if cfg.mode != "no_done":
                yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _chunk(chat: bool, text: str | None, role: bool = False) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return {"id": "x", "object": "chat.completion.chunk", "model": MODEL_ID, "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": None}
    return {"id": "x", "object": "text_completion", "model": MODEL_ID, "choices": [choice]}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"

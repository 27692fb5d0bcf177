"""Server-sent events: OpenAI's chunk format, errors inside and before a stream, disconnects."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

import httpx
import pytest
import uvicorn

from fake_engine import FakeEngine
from flashserve.api.server import build_app

pytestmark = pytest.mark.anyio
MODEL = "smollm2"


async def stream(engine: FakeEngine, tokenizer: Any, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    app = build_app(engine, tokenizer, [MODEL], kw.pop("max_model_len", 2048))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post(path, json={"model": MODEL, "stream": True, **body})


def events(r: httpx.Response) -> list[Any]:
    """The stream's events, checking OpenAI's framing: `data: <payload>` blocks split by a blank line."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("\n\n")
    blocks = r.text[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), r.text
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


HI = {"messages": [{"role": "user", "content": "Hi"}]}


async def test_chat_stream_starts_with_the_role_and_ends_with_done(tokenizer: Any) -> None:
    chunks = events(await stream(FakeEngine(), tokenizer, "/v1/chat/completions", HI))
    assert chunks[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello, world!"


async def test_chat_stream_has_one_finish_reason_chunk_last(tokenizer: Any) -> None:
    chunks = events(await stream(FakeEngine(), tokenizer, "/v1/chat/completions", {**HI, "max_tokens": 2}))
    finishing = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert finishing == [chunks[-1]]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert "usage" not in chunks[-1]


async def test_include_usage_adds_a_final_usage_chunk_without_choices(tokenizer: Any) -> None:
    body = {"prompt": [1, 2, 3], "stream_options": {"include_usage": True}}
    chunks = events(await stream(FakeEngine(), tokenizer, "/v1/completions", body))
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}
    }
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_completion_stream_chunks_are_text_completions(tokenizer: Any) -> None:
    chunks = events(await stream(FakeEngine(), tokenizer, "/v1/completions", {"prompt": "Hi"}))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": None}]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stream_with_n_two_opens_and_finishes_each_choice(tokenizer: Any) -> None:
    chunks = events(await stream(FakeEngine(), tokenizer, "/v1/chat/completions", {**HI, "n": 2}))
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["stop"]
        assert "".join(m["delta"].get("content", "") for m in mine) == "Hello, world!"


async def test_tokenizer_free_stream_sends_a_chunk_per_token() -> None:
    chunks = events(await stream(FakeEngine(), None, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3}))
    assert len(chunks) == 4  # three tokens and the finish_reason chunk


async def test_engine_error_mid_stream_is_an_error_event_then_done(tokenizer: Any) -> None:
    chunks = events(await stream(FakeEngine(error_after=2), tokenizer, "/v1/chat/completions", HI))
    assert chunks[-1]["error"]["message"] == "boom" and chunks[-1]["error"]["type"] == "server_error"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hello,"


async def test_engine_error_before_the_first_token_is_http_500(tokenizer: Any) -> None:
    r = await stream(FakeEngine(error_after=0), tokenizer, "/v1/chat/completions", HI)
    assert r.status_code == 500 and r.json()["error"]["message"] == "boom"


async def test_dead_engine_is_http_503_even_when_streaming(tokenizer: Any) -> None:
    r = await stream(FakeEngine(dead=True), tokenizer, "/v1/chat/completions", HI)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


async def test_context_overflow_is_http_400_before_the_stream_starts(tokenizer: Any) -> None:
    body = {"prompt": [1] * 8, "max_tokens": 3}
    r = await stream(FakeEngine(), tokenizer, "/v1/completions", body, max_model_len=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_stream_options_without_stream_is_400(tokenizer: Any) -> None:
    body = {**HI, "stream": False, "stream_options": {"include_usage": True}}
    r = await stream(FakeEngine(), tokenizer, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


# ---- disconnects, over a real socket -----------------------------------------------------------


@pytest.fixture
def serve(tokenizer: Any) -> Iterator[Callable[[FakeEngine], str]]:
    """Runs the app under uvicorn in a thread; yields a function that starts it and gives its URL."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(engine: FakeEngine) -> str:
        app = build_app(engine, tokenizer, [MODEL], 2048)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(5)


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


SLOW_SCRIPT = [(100 + i, f" t{i}") for i in range(500)]


def test_closing_a_stream_after_one_chunk_aborts_the_engine_request(serve: Callable[[FakeEngine], str]) -> None:
    engine = FakeEngine(SLOW_SCRIPT, delay=0.02)
    url = serve(engine)
    with httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json={"model": MODEL, "stream": True, **HI}) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert first.startswith("data: ")
    assert wait_for(lambda: len(engine.request_ids) == 1 and engine.request_ids[0] in engine.closed)
    assert engine.request_ids[0] in engine.aborted
    assert not engine.finished


def test_a_client_leaving_a_non_streaming_request_aborts_it(serve: Callable[[FakeEngine], str]) -> None:
    engine = FakeEngine(SLOW_SCRIPT, delay=0.02)
    url = serve(engine)
    with httpx.Client(base_url=url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json={"model": MODEL, **HI})
    assert wait_for(lambda: len(engine.request_ids) == 1 and engine.request_ids[0] in engine.closed)
    assert engine.request_ids[0] in engine.aborted


async def test_stream_events_are_sent_without_a_timeout_scope_each(tokenizer: Any, monkeypatch: Any) -> None:
    # At 100 streams anyio's per-send timeout scope was a fifth of the event loop's time.
    import anyio

    def no_scope(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a timeout scope around a send")

    monkeypatch.setattr(anyio, "move_on_after", no_scope)
    chunks = events(await stream(FakeEngine(), tokenizer, "/v1/chat/completions", HI))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello, world!"

"""The engine requests behind one API request, and their OpenAI SSE chunks.

One API request fans out into one engine request per choice (n choices per prompt). A pump task per
choice reads that choice's engine iterator into one shared queue, so choices interleave in the
order the engine produces them and closing never races an iterator that another task is inside.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence, TypeVar

import orjson
from sse_starlette import EventSourceResponse
from starlette.requests import Request

from flashserve.api.choices import ChoiceResult
from flashserve.api.errors import APIError, SERVER_ERROR, UNAVAILABLE, engine_dead, invalid, overloaded
from flashserve.client.protocol import EngineClient
from flashserve.message.errors import EngineDead, EngineOverloaded
from flashserve.message.lora import LoRARequest
from flashserve.message.outputs import RequestOutput, error_output
from flashserve.message.sampling_params import InvalidParameter, SamplingParams
from flashserve.metrics import RequestRecord

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")

# nginx's code for "client closed request": nobody reads it, but logs show what happened.
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The client disconnected before the response began."""


async def _wait_for_disconnect(raw: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising ClientGone if the client goes away first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        task.cancel()
        watch.cancel()


class EngineStreams:
    """Owns the engine iterators of one API request: start them, merge them, close them."""

    def __init__(
        self,
        engine: EngineClient,
        request_ids: Sequence[str],
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        record: RequestRecord | None = None,  # metrics and the request's log line
        group: str | None = None,  # the API request's id: its choices share one fair share
        cache_salt: str | None = None,
        choices_per_prompt: int = 1,  # n: choice i belongs to prompt i // n
        stream: bool = True,  # False: only collect() reads it, so the engine may merge outputs
        lora_request: LoRARequest | None = None,  # the LoRA adapter its `model` names; None: the base model
    ) -> None:
        self._engine = engine
        # Passed only when set: engines that serve the base model only need not take it.
        self._lora = {"lora_request": lora_request} if lora_request is not None else {}
        self._ids = list(request_ids)
        self._group = group
        self._cache_salt = cache_salt
        self._choices_per_prompt = choices_per_prompt
        self._stream = stream
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._buffer: deque[tuple[int, RequestOutput]] = deque()
        self._finished = [False] * len(self._ids)
        self._engine_dead = False
        self._refusals: dict[int, APIError] = {}  # choices the engine refused at generate()
        self._record = record
        self.num_output_tokens = [0] * len(self._ids)
        self.num_cached_tokens = [0] * len(self._ids)
        self._pumps = [
            asyncio.ensure_future(self._pump(i, prompt, p))
            for i, (prompt, p) in enumerate(zip(prompts, params))
        ]

    @property
    def num_choices(self) -> int:
        return len(self._ids)

    async def _pump(self, index: int, prompt: list[int], params: SamplingParams) -> None:
        request_id = self._ids[index]
        stream: AsyncIterator[RequestOutput] | None = None
        finished = False
        try:
            # Inside the try: an engine may refuse at the call (EngineDead) or at the first step.
            stream = self._engine.generate(request_id, prompt, params, group=self._group,
                                           cache_salt=self._cache_salt, stream=self._stream, **self._lora)
            async for out in stream:
                finished = out.finished
                self._queue.put_nowait((index, out))
                if finished:
                    return
            self._queue.put_nowait((index, error_output(request_id, 0, "the engine stream ended early")))
        except (EngineDead, EngineOverloaded, InvalidParameter) as exc:
            self._queue.put_nowait((index, exc))
        except Exception as exc:
            logger.exception("engine request %s failed", request_id)
            self._queue.put_nowait((index, exc))
        finally:
            aclose = getattr(stream, "aclose", None) if stream is not None else None
            if not finished and aclose is not None:  # the engine aborts a request on close
                try:
                    await aclose()
                except Exception:
                    logger.exception("closing engine stream %s failed", request_id)

    async def _next(self) -> tuple[int, RequestOutput]:
        index, item = await self._queue.get()
        if isinstance(item, BaseException):
            self._engine_dead |= isinstance(item, EngineDead)
            message = str(item) or type(item).__name__
            if isinstance(item, EngineOverloaded):
                self._refusals[index] = overloaded(message, code="queue_full")
            elif isinstance(item, EngineDead):
                self._refusals[index] = engine_dead(message)
            elif isinstance(item, InvalidParameter):  # the engine refused a token id
                self._refusals[index] = invalid(message, item.param)
            item = error_output(self._ids[index], 0, message)
        if item.finished:
            self._finished[index] = True
        self.num_output_tokens[index] = max(self.num_output_tokens[index], item.num_output_tokens)
        # max: a failure stand-in (error_output) carries 0 and must not erase a count already seen.
        self.num_cached_tokens[index] = max(self.num_cached_tokens[index], item.num_cached_tokens)
        if self._record is not None:
            self._record.tokens(index, len(item.new_token_ids), item.num_output_tokens)
            self._record.scheduled(item.arrival_time, item.scheduled_time)
            if item.finished:
                self._record.finish(index, item.finish_reason or "stop")
        return index, item

    def failure(self, index: int, out: RequestOutput) -> APIError | None:
        """The HTTP error an output stands for, or None for an ordinary output."""
        if index in self._refusals:
            return self._refusals[index]
        if out.finish_reason == "abort":
            # Only the server aborts a request someone still reads: a queue timeout or shutdown.
            return overloaded(out.error or "the request was aborted by the server", code="aborted")
        if out.finish_reason != "error" and out.error is None:
            return None
        if self._engine_dead or not self._engine.is_healthy():
            return APIError(503, out.error or "the engine is not running", UNAVAILABLE, code="engine_dead")
        return APIError(500, out.error or "generation failed", SERVER_ERROR)

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Cached prompt tokens counted the way prompt_tokens counts the prompt: once per prompt
        however many choices it has. Per prompt, the fewest any of its choices saw: the choice
        that computed the prompt saw only what was cached before, its siblings then reused its pages."""
        n = self._choices_per_prompt
        cached = self.num_cached_tokens
        return sum(min(cached[i:i + n]) for i in range(0, len(cached), n))

    async def start(self) -> None:
        """Wait for every choice's first output, so a failure before the first token is still an
        HTTP error status rather than an event inside a 200 stream. Raises APIError."""
        seen = [False] * len(self._ids)
        while not all(seen):
            index, out = await self._next()
            err = self.failure(index, out)
            if err is not None:
                raise err
            seen[index] = True
            self._buffer.append((index, out))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) pairs until every choice has finished; failures included."""
        while self._buffer:
            yield self._buffer.popleft()
        while not all(self._finished):
            yield await self._next()

    async def collect(self) -> list[ChoiceResult]:
        results = [ChoiceResult(i) for i in range(len(self._ids))]
        async for index, out in self.outputs():
            err = self.failure(index, out)
            if err is not None:
                raise err
            results[index].add(out)
        return results

    def close(self) -> None:
        """Abort whatever has not finished. Synchronous on purpose: it runs in `finally` blocks of
        cancelled tasks, where an await could be cancelled again before the aborts go out."""
        for pump in self._pumps:
            pump.cancel()
        for request_id, finished in zip(self._ids, self._finished):
            if not finished:
                self._engine.abort(request_id)
        if self._record is not None:
            self._record.close()

    async def aclose(self) -> None:
        self.close()


def usage(num_prompt_tokens: int, num_output_tokens: Sequence[int], num_cached_tokens: int = 0) -> dict[str, Any]:
    completion = sum(num_output_tokens)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


class SSEResponse(EventSourceResponse):
    """sse-starlette's response, sending each event straight to the ASGI `send` when no send
    timeout is set. sse-starlette opens an anyio timeout scope around every send, even without a
    timeout, and at 100 streams that scope took about a fifth of the event loop's time
    (`benchmark.api_host` under py-spy, counting the samples that held the GIL)."""

    async def _send_with_timeout(self, send: Any, message: Any) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def encode(payload: dict[str, Any]) -> bytes:
    """One server-sent event. orjson: a chunk is encoded for every token of every stream, and the
    standard library's encoder was a tenth of the server's CPU time at 100 streams. A chunk holds
    no NaN or infinity (logprobs are floored at -9999.0), which orjson would write as null."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chat_opening(index: int) -> dict[str, Any]:
    """A chat choice's first delta names the role, as OpenAI's does."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


class ChoiceStream(Protocol):
    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The `choices[]` entries to send for one engine output of this choice, one chunk each."""
        ...


async def sse_chunks(
    streams: EngineStreams,
    *,
    head: dict[str, Any],  # id, object, created, model: the same on every chunk
    choices: Sequence[ChoiceStream],  # one per choice: shapes its outputs
    opening: Sequence[dict[str, Any]] = (),  # choices sent before any token (chat's role deltas)
    num_prompt_tokens: int,
    include_usage: bool,
    first: dict[str, Any] | None = None,  # fields of the first chunk only (chat's prompt_token_ids)
    on_error: Callable[[APIError], None] = lambda err: None,  # counts error events
) -> AsyncIterator[bytes]:
    """OpenAI's `data: {chunk}` stream ending in `data: [DONE]`; closes the engine streams on exit,
    including when the client disconnects and the response task is cancelled."""
    extra = {"usage": None} if include_usage else {}
    try:
        for choice in opening:
            yield encode({**head, "choices": [choice], **extra, **(first or {})})
            first = None
        async for index, out in streams.outputs():
            err = streams.failure(index, out)
            if err is not None:
                on_error(err)
                yield encode(err.body())
                break
            for entry in choices[index].chunks(out):
                yield encode({**head, "choices": [entry], **extra})
        else:
            if include_usage:
                counts = usage(num_prompt_tokens, streams.num_output_tokens, streams.num_cached_prompt_tokens)
                yield encode({**head, "choices": [], "usage": counts})
        yield DONE
    finally:
        streams.close()

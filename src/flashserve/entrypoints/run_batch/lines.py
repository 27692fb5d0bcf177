"""Lines of an OpenAI Batch API file for `flashserve run-batch`: parse one, put the valid ones in a
prefix-sharing order, send one through the app in-process, shape its result line.

A request goes through the server's own ASGI app, so its result carries exactly the status code and
body a client of `flashserve serve` would get, errors included. The call is a few lines of ASGI
rather than an HTTP client: no socket, and no client library needed at run time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, MutableMapping

from flashserve.api.json_body import dumps, loads, loads_strict
from flashserve.api.protocol import DEFAULT_COMPLETION_TOKENS
from flashserve.engine.prefix_groups import GroupPlan, plan_prefix_groups

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)

Message = MutableMapping[str, Any]
ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]


@dataclass(frozen=True)
class BatchRequest:
    line_no: int
    custom_id: str
    url: str
    body: Any  # sent as it is: an invalid body gets the server's own error answer
    strict: bool = True  # orjson read the line (no NaN or Infinity), so it writes the body back

    @property
    def payload(self) -> bytes:
        return dumps(self.body, self.strict)


@dataclass(frozen=True)
class LineError:
    """A line that is no batch request at all: it gets an error line, not a response."""

    line_no: int
    custom_id: str | None
    code: str
    message: str


def parse_line(text: str, line_no: int) -> BatchRequest | LineError:
    try:
        item, strict = loads_strict(text)
    except ValueError as exc:
        return LineError(line_no, None, "invalid_json", f"line {line_no} is not valid JSON: {exc}")
    if not isinstance(item, dict):
        return LineError(line_no, None, "invalid_request", f"line {line_no} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line_no, None, "missing_custom_id", f"line {line_no} has no custom_id string")
    method, url = item.get("method"), item.get("url")
    if method != "POST":
        return LineError(line_no, custom_id, "invalid_method", f"method must be POST, got {method!r}")
    if url not in URLS:
        return LineError(line_no, custom_id, "invalid_url", f"url must be one of {', '.join(URLS)}, got {url!r}")
    if "body" not in item:
        return LineError(line_no, custom_id, "missing_body", f"line {line_no} has no body")
    body = item["body"]
    if isinstance(body, dict) and body.get("stream"):
        return LineError(line_no, custom_id, "invalid_request", "stream is not supported in a batch")
    return BatchRequest(line_no, custom_id, url, body, strict)


def error_line(error: LineError) -> dict[str, Any]:
    return {"id": _line_id(), "custom_id": error.custom_id, "response": None,
            "error": {"code": error.code, "message": error.message}}


def result_line(custom_id: str, status: int, request_id: str, body: bytes) -> dict[str, Any]:
    try:
        parsed: Any = loads(body)
    except ValueError:
        parsed = body.decode("utf-8", "replace")
    return {"id": _line_id(), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": parsed}, "error": None}


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


async def post(app: ASGIApp, path: str, body: bytes) -> tuple[int, str, bytes]:
    """POST `body` (JSON) to `path` of an ASGI app in-process: (status, x-request-id, body).

    The request's body is received at once; after it, `receive()` waits until the response is
    complete, as a connected client would, so the handlers' disconnect watch never fires.
    """
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"host", b"run-batch"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0), "server": ("run-batch", 80),
    }
    complete = asyncio.Event()
    sent = False
    status: int | None = None
    request_id = ""
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, request_id
        if message["type"] == "http.response.start":
            status = message["status"]
            for key, value in message.get("headers", ()):
                if key.lower() == b"x-request-id":
                    request_id = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                complete.set()

    try:
        await app(scope, receive, send)
    except Exception:
        if status is None:  # nothing was answered: the caller reports the failure
            raise
    finally:
        complete.set()
    if status is None:
        raise RuntimeError(f"the app sent no response for {path}")
    return status, request_id, b"".join(chunks)


@dataclass(frozen=True)
class BatchPlan:
    """The valid requests in submission order, and the prefix-sharing groups behind that order."""

    requests: list[BatchRequest]  # in submission order
    plan: GroupPlan  # its members index `prompts`
    prompts: list[list[int]]  # per request in input order: its prompt's token ids ([] when unread)
    salts: list[str | None]  # per request in input order: its cache_salt
    lora_keys: list[str | None]  # per request in input order: its LoRA adapter's key in the page hashes
    line_numbers: list[int]  # per request in input order
    largest_request_tokens: int  # the most tokens one request may hold (prompt and outputs)

    def member_of_line(self) -> dict[int, tuple[int, int]]:
        """line number -> (group, member): which group's prefix a line's requests share."""
        return {self.line_numbers[i]: (g, i) for g, group in enumerate(self.plan.groups) for i in group.members}


def plan_requests(requests: Sequence[BatchRequest], tokenizer: Any, page_size: int, max_model_len: int,
                  lora_ids: Mapping[str, int] | None = None) -> BatchPlan:  # fmt: skip
    """The requests in prefix-sharing order (`plan_prefix_groups`): prompts tokenized up front, as
    the server will (chat template, or the first prompt of a completion); a line whose prompt
    cannot be read here is left alone and the server answers it. `lora_ids`: the loaded LoRA
    adapters' ids by name; a request whose `model` names one shares a group only with requests of
    that adapter, whose KV pages are its own (`prefix_cache.lora_key`)."""
    prompts = _prompt_ids(requests, tokenizer)
    expected = [_expected_output(r.body, len(p), max_model_len) for r, p in zip(requests, prompts)]
    salts = [_salt(r.body) for r in requests]
    lora_keys = [_lora_key(r.body, lora_ids or {}) for r in requests]
    keys: list[Hashable] = list(zip(salts, lora_keys))
    plan = plan_prefix_groups(prompts, page_size, expected, keys)
    largest = max((min(len(p) + e, max_model_len) for p, e in zip(prompts, expected)), default=0)
    return BatchPlan([requests[i] for i in plan.order], plan, prompts, salts, lora_keys, [r.line_no for r in requests],
                     largest)  # fmt: skip


def _lora_key(body: Any, lora_ids: Mapping[str, int]) -> str | None:
    model = body.get("model") if isinstance(body, dict) else None
    lora_id = lora_ids.get(model) if isinstance(model, str) else None
    return str(lora_id) if lora_id else None


def _prompt_ids(requests: Sequence[BatchRequest], tokenizer: Any) -> list[list[int]]:
    ids: list[list[int]] = [[] for _ in requests]
    chat: list[tuple[int, str]] = []
    text: list[tuple[int, str]] = []
    for k, request in enumerate(requests):
        body = request.body
        try:
            if request.url == CHAT_URL and tokenizer is not None:
                conversation = [{"role": m["role"], "content": _content_text(m.get("content"))} for m in body["messages"]]
                chat.append((k, tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)))
            elif request.url == COMPLETIONS_URL:
                prompt = body["prompt"]
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]  # several prompts: the first one places the request
                if isinstance(prompt, str) and tokenizer is not None:
                    text.append((k, prompt))
                elif isinstance(prompt, list) and set(map(type, prompt)) <= {int}:  # one pass in C
                    ids[k] = list(prompt)
        except Exception:  # a malformed body: the server will say what is wrong with it
            continue
    # One batched call per kind: the Rust tokenizer encodes a list much faster than one by one.
    for items, special in ((chat, False), (text, True)):
        if items:
            encoded = tokenizer([t for _, t in items], add_special_tokens=special, return_attention_mask=False)
            for (k, _), token_ids in zip(items, encoded["input_ids"]):
                ids[k] = list(token_ids)
    return ids


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return content or ""


def _expected_output(body: Any, prompt_len: int, max_model_len: int) -> int:
    """Output tokens the request may produce: max tokens (or its default) times n."""
    if not isinstance(body, dict):
        return 1
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if "prompt" in body and "max_tokens" not in body:
        limit = DEFAULT_COMPLETION_TOKENS
    if not isinstance(limit, int) or limit < 1:
        limit = max(max_model_len - prompt_len, 1)
    n = body.get("n")
    return limit * (n if isinstance(n, int) and n > 0 else 1)


def _salt(body: Any) -> str | None:
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    return salt if isinstance(salt, str) else None

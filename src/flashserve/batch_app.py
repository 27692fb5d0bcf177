"""run-batch's app process: every batch line goes through the server's own app here, in a process of
its own, while the engine runs in the process that started this one (`flashserve.batch`).

The app's work for a line (JSON, validation, tokenizing, the handler, the response body) holds
Python's GIL; in the engine's process it would take turns with the engine loop, whose host work
bounds a step on a fast GPU. Here the two run side by side. The engine process sends an `AppSetup`
once the model is loaded; this process then sends each request the app submits (`Add`, its
grammar as a spec, which the engine process compiles) and each abort, and gets back each step's
outputs, through a pipe each way. Everything that crosses is plain data.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import IO, Any

# At module level: the spawned process imports the app (0.8 s, xgrammar and torch only on a first
# grammar) while the engine process loads the model.
from flashserve.api.options import APIOptions
from flashserve.api.server import build_app
from flashserve.batch_lines import BatchRequest, LineError, error_line, parse_line, post, result_line
from flashserve.engine.client import EngineDead
from flashserve.engine.engine import check_request
from flashserve.engine.streams import Abort, Add, OutputStreams

logger = logging.getLogger("flashserve")


@dataclass(frozen=True)
class AppSetup:
    """What the app process needs from the engine process, sent once the model is loaded."""

    tokenizer: Any
    served_model_names: list[str]
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    api: APIOptions
    input_file: str
    output_file: str
    order: list[int]  # the line numbers of the valid requests, in submission order
    max_concurrency: int
    progress: bool
    log_level: str


@dataclass(frozen=True)
class LineTag:
    """The batch line a task answers: the engine process finds the line's prefix-sharing group by
    its number (it pins the prefix), and `submitted` is set once the line's first request is in the
    engine's queue."""

    line_no: int
    submitted: asyncio.Event


class RemoteEngine(OutputStreams):
    """An `EngineClient` whose engine runs in the process at the other end of two pipes:
    `to_engine` takes ("add", (Add, grammar spec or None, batch line number or None)) and ("abort",
    Abort); `from_engine` brings ("outputs", [RequestOutput]) per step and ("dead", reason) if the
    engine loop dies. `line` is set, in each line's task, to the line the app is answering."""

    def __init__(self, max_model_len: int, vocab_size: int, to_engine: Connection, from_engine: Connection) -> None:
        super().__init__(max_model_len)
        self.vocab_size = vocab_size
        self._to_engine = to_engine
        self._from_engine = from_engine
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.line: ContextVar[LineTag | None] = ContextVar("flashserve_batch_line", default=None)

    def start(self) -> None:
        """Starts reading the engine's messages on the running event loop, as they arrive (a thread
        of their own would wait up to 5 ms for the GIL at each, behind this loop's work)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._from_engine.fileno(), self._read)

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._from_engine.fileno())
        self._fail_all("the run is over")

    def is_healthy(self) -> bool:
        return self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _admit(self, add: Add) -> None:
        check_request(add.prompt_token_ids, add.params, self.vocab_size)  # a bad id is the client's 400
        grammar = add.params.grammar
        if grammar is not None:  # compiled objects stay here; the engine process compiles the spec
            add = replace(add, params=replace(add.params, grammar=None))
        tag = self.line.get()
        self._put(("add", (add, grammar.spec if grammar is not None else None, tag.line_no if tag is not None else None)))
        if tag is not None:
            tag.submitted.set()

    def _send(self, item: Abort) -> None:
        if self._dead is None:  # else the engine is gone with every request
            try:
                self._put(("abort", item))
            except EngineDead:  # it went just now; the reader reports it
                pass

    def _put(self, message: tuple[str, Any]) -> None:
        try:
            self._to_engine.send(message)
        except OSError:  # a broken pipe: the engine process is gone
            raise EngineDead("the engine process exited") from None

    def _read(self) -> None:
        """Every message waiting in the pipe (a message is written whole, so a read that starts
        finishes at once)."""
        try:
            while self._from_engine.poll():
                self._receive(self._from_engine.recv())
        except (EOFError, OSError):  # the engine process is gone
            assert self._loop is not None
            self._loop.remove_reader(self._from_engine.fileno())
            self._receive(("dead", "the engine process exited"))

    def _receive(self, message: tuple[str, Any]) -> None:
        kind, value = message
        if kind == "outputs":
            self._dispatch(value)
        elif kind == "dead" and self._dead is None:
            self._dead = value
            self._fail_all(value)


@dataclass
class Tally:
    """What the result lines add up to, for the progress bar and the summary."""

    num_ok: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, line: dict[str, Any]) -> None:
        response = line["response"]
        if response is None or response["status_code"] != 200:
            self.num_failed += 1
            return
        self.num_ok += 1
        body = response["body"]
        usage = (body.get("usage") if isinstance(body, dict) else None) or {}
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def summary(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        total = self.num_ok + self.num_failed
        computed = self.prompt_tokens - self.cached_tokens
        return "\n".join((
            f"requests: {self.num_ok} ok, {self.num_failed} failed, {total} in {elapsed:.2f} s "
            f"({total / elapsed:.2f} requests/s)",
            f"tokens: {self.prompt_tokens} prompt ({computed} computed, {self.cached_tokens} from the prefix "
            f"cache), {self.completion_tokens} completion",
            f"throughput: {self.completion_tokens / elapsed:.1f} completion tokens/s, "
            f"{(self.prompt_tokens + self.completion_tokens) / elapsed:.1f} total tokens/s",
        ))


def import_tokenizer_classes() -> None:
    """Imports transformers' tokenizer classes, which the setup's tokenizer is unpickled into, while
    the engine process loads the model, and without torch: transformers' tokenizer module imports
    its GGUF weight converter, which imports torch where it can (4.3 s of a 5.4 s import on an H100
    machine), and this process runs no model. A grammar line imports torch later (xgrammar), as it
    would anyway."""
    if "transformers" in sys.modules:  # imported already: nothing to save
        return
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec("torch") is None: no torch
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found"
    try:
        from transformers import PreTrainedTokenizerFast  # noqa: F401
    except ImportError:  # this transformers needs torch there: the unpickling imports both, afresh
        for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
            del sys.modules[name]
    finally:
        if hidden:
            del sys.modules["torch"]


def main(to_engine: Connection, from_engine: Connection) -> None:
    """The app process: waits for the setup (None: the engine did not load), runs every line, and
    sends ("done", the run's summary)."""
    try:
        import_tokenizer_classes()
        try:
            setup = from_engine.recv()
        except EOFError:  # the engine process ended before the model loaded
            return
        if setup is None:
            return
        logging.basicConfig(level=setup.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if setup.log_level != "DEBUG":  # one log line per request would bury the progress bar
            logging.getLogger("flashserve.requests").setLevel(logging.WARNING)
        engine = RemoteEngine(setup.max_model_len, setup.vocab_size, to_engine, from_engine)
        app = build_app(engine, setup.tokenizer, setup.served_model_names, setup.max_model_len,
                        eos_token_ids=setup.eos_token_ids, options=setup.api, vocab_size=setup.vocab_size)
        with open(setup.input_file, encoding="utf-8") as f:
            items = [parse_line(text, n) for n, text in enumerate(f, 1) if text.strip()]
        errors = [item for item in items if isinstance(item, LineError)]
        by_line = {item.line_no: item for item in items if isinstance(item, BatchRequest)}
        requests = [by_line[n] for n in setup.order]
        with open(setup.output_file, "w", encoding="utf-8") as out:
            tally = asyncio.run(run_lines(app, engine, errors, requests, out, setup.max_concurrency, setup.progress))
        to_engine.send(("done", tally.summary()))
    except KeyboardInterrupt:  # the engine process, interrupted too, reports it
        sys.exit(130)


async def run_lines(app: Any, engine: RemoteEngine, errors: list[LineError], requests: list[BatchRequest],
                    out: IO[str], max_concurrency: int, progress: bool) -> Tally:
    """Every request through `app`, at most `max_concurrency` at once, in order; a result line is
    written (and flushed) as each finishes, after an error line for each malformed line.

    A line starts once the line before it is in the engine's queue (or answered without it). All
    of them at once would take their turns on this event loop at each step of the app's handling,
    so that the engine would get its first request only after every open line was parsed and
    validated (1,600 lines: 1.5 s on a fast host) and would idle meanwhile."""
    tally = Tally()
    bar = _progress_bar(len(errors) + len(requests), progress)
    last_postfix = 0.0

    def write(line: dict[str, Any]) -> None:
        nonlocal last_postfix
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()
        tally.add(line)
        if bar is None:
            return
        bar.update(1)
        now = time.perf_counter()
        if now - last_postfix > 0.5:
            last_postfix = now
            bar.set_postfix_str(f"{tally.completion_tokens / max(now - tally.start, 1e-9):.0f} tok/s", refresh=False)

    for error in errors:
        write(error_line(error))
    slots = asyncio.Semaphore(max_concurrency)
    pending: set[asyncio.Task[None]] = set()

    async def one(request: BatchRequest, tag: LineTag) -> None:
        engine.line.set(tag)  # this task's context: the requests the app submits for it
        try:
            status, request_id, body = await post(app, request.url, request.payload)
        except Exception as exc:  # the app gave no answer at all: this line fails alone
            logger.exception("request %s failed", request.custom_id)
            write(error_line(LineError(request.line_no, request.custom_id, "internal_error", str(exc))))
        else:
            write(result_line(request.custom_id, status, request_id, body))
        finally:
            tag.submitted.set()  # answered without reaching the engine (an invalid body) counts too
            slots.release()

    engine.start()
    try:
        for request in requests:  # in submission order: a task starts only when a slot is free
            await slots.acquire()
            tag = LineTag(request.line_no, asyncio.Event())
            task = asyncio.create_task(one(request, tag))
            pending.add(task)
            task.add_done_callback(pending.discard)
            await tag.submitted.wait()
        await asyncio.gather(*pending)
    finally:
        for task in pending:
            task.cancel()
        engine.shutdown()
        if bar is not None:
            rate = tally.completion_tokens / max(time.perf_counter() - tally.start, 1e-9)
            bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
            bar.close()
    return tally


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # a dependency of transformers, so normally present
        return None
    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True, desc="run-batch")

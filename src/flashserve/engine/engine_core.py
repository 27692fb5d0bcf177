"""The engine core's busy loop, the only one that drives an `LLMEngine`: receive, admit, step.

Its clients are the server's front ends and run-batch's app, each over one end of a duplex pipe
(`client/core_client.py`, in another process, or in this one: `client/async_engine.py` runs the
core in a thread), and the offline `LLM`, which submits requests and runs the core's turns itself
(`client/inproc.py`). The engine core reads what the front ends sent between steps (new requests,
aborts), runs a step (`step`: the one turn of the cycle every client gets), and sends each front
end ONE message per step with the outputs of its own requests (`message/codec.py`). It sees token
ids only: detokenizing and stop strings are the front ends' (a stop string found there comes back
as an abort).

A request's grammar arrives as a spec; the engine core compiles it in the compiler's threads, and
the request joins the engine once it is compiled, so that a compilation never stalls the step loop.

A front end that goes away (its pipe reads EOF or refuses a write) loses its requests, which are
aborted and free their pages; the others go on. Outputs go out without blocking (a `FrameQueue`
per front end): a front end that stops reading for a while (its event loop busy) gets its messages
later, in order, and the other front ends' streams do not wait for it. One that leaves more than
`MAX_UNREAD_BYTES` unread is taken for stuck and dropped as if it had gone (its pipe closes, so it
fails its requests when it reads again), rather than held in this process's memory without end.
When the step loop itself
fails (a device error), every front end gets a `Dead` and `run` returns the reason: the process
exits non-zero then.
"""

from __future__ import annotations

import concurrent.futures
import logging
import selectors
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

from flashserve.engine.heap import existing_objects_frozen
from flashserve.engine.kv_events import KVEventPublisher
from flashserve.engine.llm_engine import LLMEngine
from flashserve.engine.loop import StepRecorder, apply_abort, apply_add, expire
from flashserve.engine.prefix_pins import GroupPins
from flashserve.message.codec import (
    PROTOCOL_VERSION, AddRequest, Dead, EngineSetup, FrameQueue, Hello, StepOutputs, recv, send,
)
from flashserve.message.outputs import RequestOutput, error_output
from flashserve.message.requests import Abort
from flashserve.metrics import Metrics

logger = logging.getLogger(__name__)

# While grammars compile and nothing runs: how long to wait for messages before checking again.
COMPILE_POLL_SECONDS = 0.002
# Outputs a front end may leave unread before it is dropped: a step's message for 100 streams is
# about 6.5 KB (`benchmark.codec_bench`), so this is some 40,000 steps of a stalled event loop.
MAX_UNREAD_BYTES = 256 << 20
# When the step loop died: how long the front ends get to read what waits for them and the `Dead`
# (a front end that does not read by then still sees the pipe close when this process exits).
DEAD_NOTICE_SECONDS = 5.0


class EngineCore:
    """`compile_grammar(spec)` returns a compiled grammar or a concurrent Future of one."""

    def __init__(
        self,
        engine: LLMEngine,
        setup: EngineSetup | None = None,
        compile_grammar: Callable[[Any], Any] | None = None,
        metrics: Metrics | None = None,
        queue_timeout: float | None = None,
        pins: GroupPins | None = None,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        """`setup`: what `connect` sends each front end (None for a core only `submit` feeds).
        `pins`: an offline batch's prefix-sharing groups (run-batch, `LLM`), pinned as their
        requests (`AddRequest.prefix_member`) come and go. `kv_events`: publishes each step's KV
        cache events (`--kv-events-config`)."""
        self.engine = engine
        self.setup = setup
        self.compile_grammar = compile_grammar
        self.queue_timeout = queue_timeout
        self.pins = pins
        self.kv_events = kv_events
        if kv_events is not None:
            engine.scheduler.kv_cache.record_events()
        self._group_of: dict[str, int] = {}  # request id -> its pinned group
        self._recorder = StepRecorder(engine, metrics)
        self._recorder.record([], time.monotonic())  # every gauge at its value before any front end asks
        self._conns: list[Connection] = []
        self._owner: dict[str, Connection | None] = {}  # request id -> its front end (None: `submit`'s caller)
        self._compiling: list[tuple[AddRequest, Connection | None, Any]] = []  # (request, front end, future)
        self._waiting_sent: dict[Connection, int] = {}  # the queue length each front end last heard
        self._out: dict[Connection, FrameQueue] = {}  # what each front end has yet to read
        # One selector for the whole run (multiprocessing's `wait` builds one per call): every
        # front end's read side, and the write side of those with outputs waiting.
        self._selector = selectors.DefaultSelector()
        self._interests: dict[int, int] = {}  # descriptor -> events registered

    def connect(self, conn: Connection) -> bool:
        """The handshake with one front end: its Hello, then the setup (or a Dead on a version
        mismatch); False if it did not come through."""
        try:
            hello = recv(conn)
            if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
                send(conn, Dead(f"front end speaks {hello!r}; this engine core speaks version {PROTOCOL_VERSION}"))
                return False
            send(conn, self.setup)
        except (EOFError, OSError):
            return False
        self._conns.append(conn)
        self._waiting_sent[conn] = 0
        self._out[conn] = FrameQueue(conn)
        self._interest(conn.fileno(), selectors.EVENT_READ, True)
        return True

    def run(self) -> str | None:
        """Serves until every front end is gone (returns None) or the step loop fails (returns why)."""
        try:
            return self._run()
        finally:
            if self.pins is not None:
                self.pins.release_all()

    def _run(self) -> str | None:
        with existing_objects_frozen():
            while self._conns:
                received = self._receive(wait_for=self._idle_wait())
                try:
                    outputs = self.step(received)
                except Exception as exc:  # the loop died: every front end hears it
                    logger.exception("engine loop died")
                    return self._die(f"engine loop died: {exc!r}")
                self._deliver(outputs)
        return None

    def submit(self, message: AddRequest | Abort) -> RequestOutput | None:
        """A request, or an abort, from a client in this process that steps the core itself
        (`client/inproc.py`); the output of a request refused at once, or of the one aborted. Its
        other outputs come back from `step`."""
        return self._apply(None, message)

    def step(self, received: Sequence[RequestOutput] = ()) -> list[RequestOutput]:
        """One turn of the cycle, after the messages that came in (`received`: the outputs they
        made, of requests refused or aborted): admit the requests whose grammars compiled, end
        those that waited too long, step the engine, publish the KV cache events and the turn's
        numbers. Returns every output of the turn; raises what the engine's step raised."""
        outputs = [*received, *self._admit_compiled()]
        # After the requests that came in got their arrival times (a request that woke an idle
        # loop arrived after the wait began): queue times are never negative.
        start = time.monotonic()
        outputs += expire(self.engine, self.queue_timeout, start)
        generated = 0
        if self.engine.has_unfinished:
            outputs += self.engine.step()
            generated = self.engine.num_step_tokens
            if self.kv_events is not None:
                self.kv_events.publish(self.engine.scheduler.kv_cache.take_events())
        self._recorder.record(outputs, start, generated)
        for out in outputs:
            if out.finished:
                if self._group_of and (group := self._group_of.pop(out.request_id, None)) is not None:
                    self.pins.finished(group)  # type: ignore[union-attr]
                if out.request_id in self._owner and self._owner[out.request_id] is None:  # submit()'s
                    del self._owner[out.request_id]
        return outputs

    def _idle_wait(self) -> float | None:
        if self.engine.has_unfinished:
            return 0.0
        return COMPILE_POLL_SECONDS if self._compiling else None

    # ---- from the front ends -------------------------------------------------------------------
    def _receive(self, wait_for: float | None) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for conn in self._wait(wait_for):
            try:
                while conn.poll():
                    out = self._apply(conn, recv(conn))
                    if out is not None:
                        outputs.append(out)
            except (EOFError, OSError):
                self._drop(conn)
        return outputs

    def _wait(self, timeout: float | None) -> list[Connection]:
        """The front ends with messages to read, after up to `timeout` s (None: until one has).
        Meanwhile what waits for a front end goes out as it reads."""
        behind = []
        for conn in self._conns:
            queue = self._out[conn]
            self._interest(queue.fd, selectors.EVENT_WRITE, queue.pending)
            if queue.pending:
                behind.append(conn)
        ready = {key.fd: mask for key, mask in self._selector.select(timeout)}
        for conn in behind:
            if ready.get(self._out[conn].fd, 0) & selectors.EVENT_WRITE:
                self._flush(conn)
        return [conn for conn in self._conns if ready.get(conn.fileno(), 0) & selectors.EVENT_READ]

    def _interest(self, fd: int, event: int, on: bool) -> None:
        """Waits for `event` on `fd` from now on, or no longer."""
        before = self._interests.get(fd, 0)
        after = before | event if on else before & ~event
        if after == before:
            return
        if not before:
            self._selector.register(fd, after)
        elif not after:
            self._selector.unregister(fd)
        else:
            self._selector.modify(fd, after)
        if after:
            self._interests[fd] = after
        else:
            del self._interests[fd]

    def _flush(self, conn: Connection) -> None:
        try:
            self._out[conn].flush()
        except OSError:
            self._drop(conn)

    def _apply(self, conn: Connection | None, message: Any) -> RequestOutput | None:
        if isinstance(message, Abort):
            out = apply_abort(self.engine, message)
            if out is None:  # unknown to the engine: finished already, or its grammar still compiles
                self._owner.pop(message.request_id, None)
                if (group := self._group_of.pop(message.request_id, None)) is not None:
                    self.pins.finished(group)  # type: ignore[union-attr]
            return out
        if not isinstance(message, AddRequest):
            logger.warning("ignoring an unexpected message from a front end: %r", type(message).__name__)
            return None
        add = message.add
        self._owner[add.request_id] = conn
        if self.pins is not None and message.prefix_member is not None:  # pinned before it can be scheduled
            self.pins.submitted(*message.prefix_member)
            self._group_of[add.request_id] = message.prefix_member[0]
        if message.grammar_spec is None:
            return apply_add(self.engine, add)
        if self.compile_grammar is None:
            return error_output(add.request_id, len(add.prompt_token_ids), "this engine compiles no grammars")
        try:
            compiled = self.compile_grammar(message.grammar_spec)
        except Exception as exc:
            return error_output(add.request_id, len(add.prompt_token_ids), f"grammar compilation failed: {exc}")
        if isinstance(compiled, concurrent.futures.Future):
            self._compiling.append((message, conn, compiled))
            return None
        return apply_add(self.engine, add, replace(add.params, grammar=compiled))

    def _admit_compiled(self) -> list[RequestOutput]:
        if not self._compiling:
            return []
        outputs: list[RequestOutput] = []
        still: list[tuple[AddRequest, Connection | None, Any]] = []
        for message, conn, future in self._compiling:
            add = message.add
            if (conn is not None and conn not in self._waiting_sent) or add.request_id not in self._owner:
                # its front end is gone, or it was aborted meanwhile
                continue
            if not future.done():
                still.append((message, conn, future))
                continue
            try:
                grammar = future.result()
            except Exception as exc:
                outputs.append(error_output(add.request_id, len(add.prompt_token_ids),
                                            f"grammar compilation failed: {exc}"))
                continue
            out = apply_add(self.engine, add, replace(add.params, grammar=grammar))
            if out is not None:
                outputs.append(out)
        self._compiling = still
        return outputs

    def _drop(self, conn: Connection) -> None:
        """A front end is gone: abort its requests, forget it."""
        if conn not in self._waiting_sent:
            return
        num_open = sum(owner is conn for owner in self._owner.values())
        logger.log(logging.WARNING if num_open else logging.INFO,
                   "a front end went away; aborting its %d requests", num_open)
        self._conns.remove(conn)
        del self._waiting_sent[conn]
        queue = self._out.pop(conn)
        queue.clear()
        self._interest(queue.fd, selectors.EVENT_WRITE, False)
        self._interest(conn.fileno(), selectors.EVENT_READ, False)
        for request_id in [rid for rid, owner in self._owner.items() if owner is conn]:
            del self._owner[request_id]
            self.engine.abort(request_id)
        conn.close()

    # ---- to the front ends ---------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One message per front end that has outputs, or whose idea of the queue length is stale."""
        by_conn: dict[Connection, list[RequestOutput]] = {}
        owner = self._owner
        for out in outputs:
            conn = owner.pop(out.request_id, None) if out.finished else owner.get(out.request_id)
            if conn is not None:
                by_conn.setdefault(conn, []).append(out)
        # Grammars still compiling count as waiting: they are in the engine's queue for the client.
        num_waiting = self.engine.scheduler.num_waiting + len(self._compiling)
        for conn in list(self._conns):
            mine = by_conn.get(conn)
            if mine is None and self._waiting_sent[conn] == num_waiting:
                continue
            self._waiting_sent[conn] = num_waiting
            queue = self._out[conn]
            try:
                queue.put(StepOutputs(mine or [], num_waiting))
            except OSError:
                self._drop(conn)
                continue
            if queue.backlog > MAX_UNREAD_BYTES:
                logger.error("a front end left %.1f MB of outputs unread; dropping it", queue.backlog / 1e6)
                self._drop(conn)

    def _die(self, reason: str) -> str:
        """Every front end hears why, after what waits for it, for up to DEAD_NOTICE_SECONDS."""
        behind = []
        for conn in list(self._conns):
            try:
                if self._out[conn].put(Dead(reason)):
                    behind.append(conn)
            except OSError:
                pass
        deadline = time.monotonic() + DEAD_NOTICE_SECONDS
        while behind and (left := deadline - time.monotonic()) > 0:
            with selectors.DefaultSelector() as selector:
                for conn in behind:
                    selector.register(self._out[conn].fd, selectors.EVENT_WRITE, conn)
                writable = [key.data for key, _ in selector.select(left)]
            for conn in writable:
                try:
                    if not self._out[conn].flush():
                        behind.remove(conn)
                except OSError:
                    behind.remove(conn)
        return reason

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._conns.clear()
        self._selector.close()

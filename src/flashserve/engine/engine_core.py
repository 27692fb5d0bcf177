"""The engine core's busy loop, the only one that drives an `LLMEngine`: receive, admit, step.

Its clients are the server's front ends and run-batch's app, each over one end of a duplex pipe
(`client/core_client.py`, in another process, or in this one: `client/async_engine.py` runs the
core in a thread), and the offline `LLM`, which submits requests and runs the core's turns itself
(`client/inproc.py`). The engine core reads what the front ends sent between steps (new requests,
aborts), runs a step (`step`: the one turn of the cycle every client gets), and sends each front
end ONE message per step with the outputs of its own requests (`message/codec.py`). It sees token
ids only: detokenizing and stop strings are the front ends' (a stop string found there comes back
as an abort).

LoRA adapters: a request's adapter (`Add.lora_request`) is looked up by name in the engine's
registry (`engine/lora_registry.py`) and loaded on the way in if it is not loaded yet (the offline
`LLM`'s adapters); a front end's `LoRAUpdate` loads or unloads one through the same registry, and
every front end then hears the adapters (`LoRAAdapters`) before the asking one gets its answer
(`LoRAUpdateDone`), so that a request it sends after the answer finds the adapter. An adapter with
running or waiting requests is not unloaded (`LoRAInUse`).

A request's grammar arrives as a spec; the engine core compiles it in the compiler's threads, and
the request joins the engine once it is compiled, so that a compilation never stalls the step loop.

A front end that goes away, or stops reading for too long (`engine/front_ends.py`, which holds the
pipes), loses its requests, which are aborted and free their pages; the others go on. When the step
loop itself fails (a device error), every front end gets a `Dead` and `run` returns the reason: the
process exits non-zero then.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import Counter
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

from flashserve.engine.front_ends import FrontEnds
from flashserve.engine.heap import existing_objects_frozen
from flashserve.engine.kv_events import KVEventPublisher
from flashserve.engine.llm_engine import LLMEngine
from flashserve.engine.loop import StepRecorder, apply_abort, apply_add, expire
from flashserve.engine.prefix_pins import GroupPins
from flashserve.message.codec import AddRequest, EngineSetup, LoRAAdapters, LoRAUpdate, LoRAUpdateDone, recv
from flashserve.message.lora import LoRAAdapterError
from flashserve.message.outputs import RequestOutput, error_output
from flashserve.message.requests import Abort
from flashserve.metrics import Metrics

logger = logging.getLogger(__name__)

# While grammars compile and nothing runs: how long to wait for messages before checking again.
COMPILE_POLL_SECONDS = 0.002


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
            kv_events.lora_names.update({a.lora_int_id: a.lora_name for a in engine.loras.adapters})
        self._group_of: dict[str, int] = {}  # request id -> its pinned group
        self._recorder = StepRecorder(engine, metrics)
        self._recorder.record([], time.monotonic())  # every gauge at its value before any front end asks
        self.front_ends = FrontEnds(on_drop=self._abort_requests_of)
        self._owner: dict[str, Connection | None] = {}  # request id -> its front end (None: `submit`'s caller)
        self._compiling: list[tuple[AddRequest, Connection | None, Any]] = []  # (request, front end, future)

    def connect(self, conn: Connection) -> bool:
        """The handshake with one front end: its Hello, then the setup (or a Dead on a version
        mismatch); False if it did not come through."""
        return self.front_ends.connect(conn, self.setup)

    def run(self) -> str | None:
        """Serves until every front end is gone (returns None) or the step loop fails (returns why)."""
        try:
            return self._run()
        finally:
            if self.pins is not None:
                self.pins.release_all()
            if (late := self.engine.late) is not None and late.num_deadlines:
                logger.info("late launches: %d held to a deadline, %d of them found the step before ended "
                            "(decode step %.2f ms, launch %.2f ms, margin %.2f ms)", late.num_deadlines, late.num_late,
                            1e3 * (late.decode_s or 0.0), 1e3 * (late.launch_s or 0.0), 1e3 * late.margin_s)
            elif late is not None and late.decode_s is not None and late.decode_s < late.min_decode_s:
                logger.info("late launches: none (decode steps of %.2f ms on the device, under the %.0f ms that "
                            "--late-launch's default asks)", 1e3 * late.decode_s, 1e3 * late.min_decode_s)

    def _run(self) -> str | None:
        with existing_objects_frozen():
            while self.front_ends:
                received = self._receive(wait_for=self._idle_wait())
                # Late launches: keep receiving until shortly before the step on the device ends, so
                # that what arrives meanwhile joins the step launched behind it.
                deadline = self.engine.launch_deadline()
                while deadline is not None and self.front_ends and (left := deadline - time.monotonic()) > 0:
                    received += self._receive(wait_for=left)
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
        for conn in self.front_ends.readable(wait_for):
            try:
                while conn.poll():
                    out = self._apply(conn, recv(conn))
                    if out is not None:
                        outputs.append(out)
            except (EOFError, OSError):
                self.front_ends.drop(conn)
        return outputs

    def _apply(self, conn: Connection | None, message: Any) -> RequestOutput | None:
        if isinstance(message, Abort):
            out = apply_abort(self.engine, message)
            if out is None:  # unknown to the engine: finished already, or its grammar still compiles
                self._owner.pop(message.request_id, None)
                if (group := self._group_of.pop(message.request_id, None)) is not None:
                    self.pins.finished(group)  # type: ignore[union-attr]
            return out
        if isinstance(message, LoRAUpdate):
            self._lora_update(conn, message)
            return None
        if not isinstance(message, AddRequest):
            logger.warning("ignoring an unexpected message from a front end: %r", type(message).__name__)
            return None
        add = message.add
        self._owner[add.request_id] = conn
        if self.pins is not None and message.prefix_member is not None:  # pinned before it can be scheduled
            self.pins.submitted(*message.prefix_member)
            self._group_of[add.request_id] = message.prefix_member[0]
        if add.lora_request is not None:
            try:
                message = self._with_lora_id(message)
            except LoRAAdapterError as exc:
                return error_output(add.request_id, len(add.prompt_token_ids), str(exc))
            add = message.add
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
            if (conn is not None and conn not in self.front_ends) or add.request_id not in self._owner:
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

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def _with_lora_id(self, message: AddRequest) -> AddRequest:
        """The request with its adapter's id in this engine (loaded now if it was not)."""
        lora = message.add.lora_request
        assert lora is not None
        before = self.engine.loras.adapters
        lora_id = self.engine.loras.for_request(lora)
        if self.engine.loras.adapters != before:
            self._adapters_changed()
        if lora_id == lora.lora_int_id:
            return message
        return replace(message, add=replace(message.add, lora_request=replace(lora, lora_int_id=lora_id)))

    def _lora_update(self, conn: Connection | None, message: LoRAUpdate) -> None:
        """Loads or unloads an adapter: every front end hears the adapters if they changed, then
        the asking one the answer."""
        loras = self.engine.loras
        try:
            if message.lora_path is None:
                compiling = Counter(m.add.lora_int_id for m, _, _ in self._compiling if m.add.lora_int_id)
                loras.unload(message.lora_name, self.engine.lora_requests() + compiling)
            else:
                loras.load(message.lora_name, message.lora_path, message.base_model_name)
        except LoRAAdapterError as exc:
            answer = LoRAUpdateDone(message.call_id, str(exc), type(exc).__name__)
        else:
            answer = LoRAUpdateDone(message.call_id)
            self._adapters_changed()
        if conn is not None and conn in self.front_ends:
            self.front_ends.send(conn, answer)

    def _adapters_changed(self) -> None:
        adapters = self.engine.loras.adapters
        if self.kv_events is not None:
            self.kv_events.lora_names.update({a.lora_int_id: a.lora_name for a in adapters})
        self.front_ends.send_all(LoRAAdapters(adapters))

    def _abort_requests_of(self, conn: Connection) -> None:
        """A front end is gone: abort its requests."""
        num_open = sum(owner is conn for owner in self._owner.values())
        logger.log(logging.WARNING if num_open else logging.INFO,
                   "a front end went away; aborting its %d requests", num_open)
        for request_id in [rid for rid, owner in self._owner.items() if owner is conn]:
            del self._owner[request_id]
            self.engine.abort(request_id)

    # ---- to the front ends ---------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Each front end's outputs, and the queue length, in one message per front end."""
        by_conn: dict[Connection, list[RequestOutput]] = {}
        owner = self._owner
        for out in outputs:
            conn = owner.pop(out.request_id, None) if out.finished else owner.get(out.request_id)
            if conn is not None:
                by_conn.setdefault(conn, []).append(out)
        # Grammars still compiling count as waiting: they are in the engine's queue for the client.
        self.front_ends.send_step(by_conn, self.engine.scheduler.num_waiting + len(self._compiling))

    def _die(self, reason: str) -> str:
        self.front_ends.send_dead(reason)
        return reason

    def close(self) -> None:
        self.front_ends.close()

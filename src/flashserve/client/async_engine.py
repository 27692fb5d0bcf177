"""`AsyncEngine`: the `EngineClient` of a server that runs its engine in this process.

The engine runs as it does in an engine core process: an `EngineCore` busy loop (`engine/engine_core.py`),
here in a background thread, fed over one end of a pipe, while this client holds the other end on
the event loop as a front end does (`EngineCoreClient`): admission (`max_waiting`, token ids the
model cannot take), detokenizing and stop strings, the streams, and a dead engine all behave as
they do behind `flashserve serve`. Each step's outputs come back in one message, so a handler
wakes once per step, not once per token, and a request that is not streamed twice.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from multiprocessing import Pipe
from typing import Callable

from flashserve.client.core_client import EngineCoreClient
from flashserve.engine.engine_core import EngineCore
from flashserve.engine.llm_engine import LLMEngine
from flashserve.message.codec import EngineSetup, Hello, PROTOCOL_VERSION, recv, send
from flashserve.metrics import Metrics

logger = logging.getLogger(__name__)


class AsyncEngine(EngineCoreClient):
    """An `EngineClient` over an `LLMEngine` whose engine core loop runs in a background thread.

    `max_waiting` bounds the requests queued for the engine (new or preempted): past it,
    `generate()` raises EngineOverloaded. `queue_timeout` (seconds) aborts a request, with an
    error, that has not been scheduled that long after it arrived. `on_dead(reason)` runs on the
    event loop once the engine loop has died and every open stream has got its error: a server
    exits then, so that its supervisor restarts it (a CUDA error poisons the whole process).
    The engine's text is this client's from now on (the core sends token ids only).
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_model_len: int,
        metrics: Metrics | None = None,
        max_waiting: int | None = None,
        queue_timeout: float | None = None,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        if queue_timeout is not None and queue_timeout <= 0:
            raise ValueError(f"queue_timeout must be positive, got {queue_timeout}")
        setup = EngineSetup(PROTOCOL_VERSION, engine.tokenizer, "", max_model_len, (), engine.vocab_size,
                            engine.scheduler.config.max_num_seqs, engine.loras.enabled, engine.loras.adapters)
        ours, theirs = Pipe()
        super().__init__(ours, setup, max_waiting, on_dead)
        engine.set_tokenizer(None)
        self.engine = engine
        self.metrics = metrics
        self.queue_timeout = queue_timeout
        # The core's copy of the setup goes through the pipe before anyone reads it: no tokenizer.
        self._core = EngineCore(engine, replace(setup, tokenizer=None), metrics=metrics, queue_timeout=queue_timeout)
        self._core_end = theirs
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the engine loop; call from the event loop that will consume the outputs."""
        send(self._conn, Hello(PROTOCOL_VERSION, 0))
        if not self._core.connect(self._core_end):
            raise RuntimeError("the engine core refused its in-process front end")
        recv(self._conn)  # its setup, which this client already has
        self._thread = threading.Thread(target=self._serve, name="flashserve-engine", daemon=True)
        self._thread.start()
        super().start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop; requests still open end with an error instead of waiting forever."""
        super().shutdown()  # our end closes: the core drops its one front end, and its loop ends
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._core_end.close()

    def is_healthy(self) -> bool:
        return super().is_healthy() and self._thread is not None and self._thread.is_alive()

    def _serve(self) -> None:
        try:
            self._core.run()  # a step that failed has told this client already (a Dead)
        except BaseException:  # its pipe closes below, which this client reads as the engine gone
            logger.exception("engine loop died")
        finally:
            self._core.close()

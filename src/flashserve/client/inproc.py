"""`InprocClient`: the engine core's client in the caller's own thread (the offline `LLM`).

No pipe and no thread: `add` hands a request to the `EngineCore` at once (admitted first, as every
`CoreClient` admits), `abort` likewise, and `outputs` runs one turn of the core's cycle (admit,
expire, step, publish) and returns its outputs, as vLLM's in-process client does over its engine
core. A turn that raises marks the core dead and raises on to the caller.
"""

from __future__ import annotations

from flashserve.client.base import CoreClient
from flashserve.engine.engine_core import EngineCore
from flashserve.message.codec import AddRequest
from flashserve.message.outputs import RequestOutput
from flashserve.message.requests import Abort


class InprocClient(CoreClient):
    def __init__(self, core: EngineCore, max_waiting: int | None = None) -> None:
        super().__init__(core.engine.vocab_size, max_waiting)
        self.core = core

    @property
    def num_live(self) -> int:
        """Requests the engine holds, unfinished."""
        return self.core.engine.num_live

    @property
    def has_unfinished(self) -> bool:
        return self.core.engine.has_unfinished

    def _submit(self, request: AddRequest) -> RequestOutput | None:
        return self.core.submit(request)

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        return self.core.submit(Abort(request_id, error))

    def outputs(self) -> list[RequestOutput]:
        """One turn of the engine core's cycle: the outputs of every request that got tokens or
        finished."""
        try:
            outputs = self.core.step()
        except Exception as exc:
            self.died(f"engine loop died: {exc!r}", ())
            raise
        self.num_waiting = self.core.engine.scheduler.num_waiting
        return outputs

    def close(self) -> None:
        self.core.close()

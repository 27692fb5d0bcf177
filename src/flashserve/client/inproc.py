"""`InprocClient`: the engine core's client in the caller's own thread (the offline `LLM`).

No pipe and no thread: `submit` hands a request (or an abort) to the `EngineCore` at once, and
`step` runs one turn of the core's cycle (admit, expire, step, publish) and returns its outputs, as
vLLM's in-process client does over its engine core.
"""

from __future__ import annotations

from flashserve.engine.engine_core import EngineCore
from flashserve.message.codec import AddRequest
from flashserve.message.outputs import RequestOutput
from flashserve.message.requests import Abort


class InprocClient:
    def __init__(self, core: EngineCore) -> None:
        self.core = core

    @property
    def num_live(self) -> int:
        """Requests the engine holds, unfinished."""
        return self.core.engine.num_live

    @property
    def has_unfinished(self) -> bool:
        return self.core.engine.has_unfinished

    def submit(self, request: AddRequest) -> RequestOutput | None:
        """Queues the request; its error output if the engine refused it."""
        return self.core.submit(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.core.submit(Abort(request_id))

    def step(self) -> list[RequestOutput]:
        """One turn of the engine core's cycle: the outputs of every request that got tokens or
        finished."""
        return self.core.step()

    def close(self) -> None:
        self.core.close()

"""`CoreClient`: what every client of an `EngineCore` is, whichever way its messages travel.

The front ends and run-batch's app reach the engine core over a pipe (`EngineCoreClient`; a server
that runs its engine in its own process too, with the core in a thread: `AsyncEngine`); the offline
`LLM` holds the core in its own thread and runs its turns (`InprocClient`), as vLLM's in-process
client does. Each of them `add`s a request, `abort`s one, takes the `outputs` the core made and
says whether the core is healthy. Written here once for all of them: admission (token ids the model
can take, the bound on waiting requests, no request for a dead core), health, and the error outputs
that end the open requests of a core that died. A transport implements `_submit`, `abort` and
`outputs`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from flashserve.engine.llm_engine import check_request
from flashserve.message.codec import AddRequest
from flashserve.message.errors import EngineDead, EngineOverloaded
from flashserve.message.outputs import RequestOutput, error_output
from flashserve.message.sampling_params import SamplingParams


class CoreClient(ABC):
    """`vocab_size`: the model's, which bounds the token ids a request may hold. `max_waiting`
    bounds the requests queued in the engine core (as of its last report, `num_waiting`, plus what
    this client sent since): past it, `add` raises EngineOverloaded. None: no bound."""

    def __init__(self, vocab_size: int, max_waiting: int | None = None) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.vocab_size = vocab_size
        self.max_waiting = max_waiting
        self.num_waiting = 0
        self._dead: str | None = None

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises InvalidParameter for token ids the model cannot take (prompt, stop ids, logit_bias)."""
        check_request(prompt_token_ids, params, self.vocab_size)

    def add(self, request: AddRequest) -> RequestOutput | None:
        """Admits a request and hands it to the engine core. Raises, with nothing queued,
        EngineDead when the core is gone, InvalidParameter for token ids the model cannot take and
        EngineOverloaded past `max_waiting`. Returns the error output of a request the core refused
        at once (in process); None when it was queued, or when a refusal comes with the outputs."""
        if not self.is_healthy():
            raise EngineDead(self.dead_reason or "the engine is not running")
        add = request.add
        self.check(add.prompt_token_ids, add.params)
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(
                f"the server is overloaded: {self.num_waiting} requests are already waiting; retry later")
        refused = self._submit(request)
        self.num_waiting += 1
        return refused

    @abstractmethod
    def _submit(self, request: AddRequest) -> RequestOutput | None:
        """Hands an admitted request to the engine core (see `add`)."""

    @abstractmethod
    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Aborts a request; safe for unknown or finished ids. `error` says why when the server,
        not the client, gave up on it. Returns the request's last output where the core answers at
        once (in process); None where it comes with the outputs."""

    @abstractmethod
    def outputs(self) -> list[RequestOutput]:
        """The outputs the engine core made since the last call, in order: in process, one turn of
        the core's cycle runs for them; over a pipe, what has arrived is read. After the core died,
        the error outputs of the requests that were open then (`died`)."""

    def is_healthy(self) -> bool:
        return self._dead is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine core died, or None while it lives (or stopped normally)."""
        return self._dead

    def died(self, reason: str, open_request_ids: Iterable[str]) -> list[RequestOutput]:
        """The engine core is gone (`reason`): from now on nothing is admitted; the requests still
        open end with these error outputs. [] when it was known to be gone already."""
        if self._dead is not None:
            return []
        self._dead = reason
        return error_outputs(reason, open_request_ids)


def error_outputs(reason: str, request_ids: Iterable[str]) -> list[RequestOutput]:
    """The last output of each request, an error saying `reason`: what a client hands the callers
    of requests its engine core will never finish."""
    return [error_output(request_id, 0, reason) for request_id in request_ids]

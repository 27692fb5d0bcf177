"""`DataParallelClient`: the `EngineClient` of a front end over the N engine cores of
`--data-parallel-size N`, one `EngineCoreClient` (and one pipe) per engine core.

Each request goes, whole, to the engine `PrefixRouter` picks (`client/router.py`): its outputs,
aborts and stop strings then stay with that engine's client. The engine cores share nothing; when
any one dies, this front end fails every open request, on every engine, and stops (`on_dead`), as
with one engine: the server exits non-zero and its supervisor starts a fresh one.

LoRA adapters load and unload on every engine core; a load that fails on one is undone on the
others. The adapters served are those every engine core has.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from flashserve.client.core_client import EngineCoreClient
from flashserve.client.router import PrefixRouter
from flashserve.message.lora import LoRAInUse, LoRANotFound, LoRARequest
from flashserve.message.outputs import RequestOutput
from flashserve.message.sampling_params import SamplingParams


class DataParallelClient:
    def __init__(self, clients: Sequence[EngineCoreClient], router: PrefixRouter) -> None:
        self.clients = list(clients)
        self.router = router
        self.max_model_len = self.clients[0].max_model_len
        self.vocab_size = self.clients[0].vocab_size
        self.lora_enabled = self.clients[0].lora_enabled
        self._on_dead: Callable[[str], None] | None = None

    @property
    def on_dead(self) -> Callable[[str], None] | None:
        return self._on_dead

    @on_dead.setter
    def on_dead(self, callback: Callable[[str], None] | None) -> None:
        self._on_dead = callback
        for client in self.clients:
            client.on_dead = self._engine_died

    def _engine_died(self, reason: str) -> None:
        """One engine core is gone: the requests on the others fail too, and the server stops."""
        for client in self.clients:
            client._fail_all(reason)  # noqa: SLF001 (one client's failure is the whole server's)
        if self._on_dead is not None:
            self._on_dead(reason)
            self._on_dead = None

    def start(self) -> None:
        for client in self.clients:
            client.start()

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()

    def is_healthy(self) -> bool:
        return all(client.is_healthy() for client in self.clients)

    @property
    def dead_reason(self) -> str | None:
        return next((c.dead_reason for c in self.clients if c.dead_reason is not None), None)

    @property
    def num_streams(self) -> int:
        return sum(client.num_streams for client in self.clients)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, group: str | None = None,
        cache_salt: str | None = None, stream: bool = True, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        loads = [client.num_streams for client in self.clients]
        lora_name = lora_request.lora_name if lora_request is not None else None
        engine = self.router.choose(prompt_token_ids, cache_salt, loads, lora_name)
        return self.clients[engine].generate(request_id, prompt_token_ids, params, group, cache_salt, stream,
                                             lora_request)

    @property
    def lora_adapters(self) -> Mapping[str, LoRARequest]:
        first, *rest = self.clients
        return {name: lora for name, lora in first.lora_adapters.items()
                if all(name in client.lora_adapters for client in rest)}

    async def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> None:
        results = await asyncio.gather(*(c.load_lora_adapter(lora_name, lora_path, base_model_name)
                                         for c in self.clients), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for client, result in zip(self.clients, results):
                if not isinstance(result, BaseException):
                    try:
                        await client.unload_lora_adapter(lora_name)
                    except Exception:  # noqa: BLE001 (the load's own error is the one to report)
                        pass
            raise failed[0]

    async def unload_lora_adapter(self, lora_name: str) -> None:
        results = await asyncio.gather(*(c.unload_lora_adapter(lora_name) for c in self.clients),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        # Not found on some engine cores only: an earlier unload got that far; it is gone now.
        if errors and (len(errors) == len(results) or not all(isinstance(e, LoRANotFound) for e in errors)):
            raise next((e for e in errors if isinstance(e, LoRAInUse)), errors[0])

    def abort(self, request_id: str, error: str | None = None) -> None:
        for client in self.clients:
            if request_id in client._streams:  # noqa: SLF001 (the engine that runs it)
                client.abort(request_id, error)
                return

    def abort_all(self, error: str) -> None:
        for client in self.clients:
            client.abort_all(error)

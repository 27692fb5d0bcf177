"""The engine core's LoRA adapters: which are loaded, under which ids, and the executor's
`add_lora` / `remove_lora` behind them.

Adapters come three ways: `--lora-modules` at start, `POST /v1/load_lora_adapter` while serving
(both *pinned*: they stay until unloaded), and a request that names an adapter not loaded yet
(`LLM.generate(lora_request=...)`), which loads it on the way in. At most `max_cpu_loras` are
loaded at once: past it a request's adapter takes the place of the least recently used unpinned
one that no request holds, and a load that finds no such place is refused. An adapter is unloaded
only when no request (running or waiting) uses it: unloading one in use is refused, so a running
stream never loses its adapter."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Protocol

from flashserve.config import LoRAConfig
from flashserve.message.lora import LoRAAdapterError, LoRARequest

logger = logging.getLogger(__name__)


class LoRAExecutor(Protocol):
    def add_lora(self, lora: LoRARequest) -> None:
        """Loads and checks the adapter on every rank; raises LoRAAdapterError."""
        ...

    def remove_lora(self, lora_int_id: int) -> bool: ...


class LoRANotFound(LoRAAdapterError):
    """No adapter of that name is loaded (HTTP 404)."""


class LoRAInUse(LoRAAdapterError):
    """The adapter has running or waiting requests (HTTP 409)."""


NOT_ENABLED = "LoRA adapters are not enabled: start the server with --enable-lora"


class LoRARegistry:
    def __init__(self, executor: Any, config: LoRAConfig | None) -> None:
        """`config`: None when LoRA is off (every load is refused then)."""
        self.executor = executor
        self.config = config
        self._by_name: dict[str, LoRARequest] = {}  # least recently used first
        self._pinned: set[str] = set()
        self._next_id = 1

    @property
    def enabled(self) -> bool:
        return self.config is not None

    @property
    def adapters(self) -> tuple[LoRARequest, ...]:
        """The loaded adapters, pinned and not."""
        return tuple(self._by_name.values())

    def name_of(self, lora_int_id: int) -> str | None:
        return next((lora.lora_name for lora in self._by_name.values() if lora.lora_int_id == lora_int_id), None)

    def load(self, name: str, path: str, base_model_name: str | None = None,
             in_use: Counter[int] | None = None) -> LoRARequest:
        """Loads an adapter that stays until unloaded, under a new id; raises LoRAAdapterError (a
        name loaded already, no room, an adapter the runner refuses)."""
        if self.config is None:
            raise LoRAAdapterError(NOT_ENABLED)
        if name in self._by_name:
            raise LoRAAdapterError(f"The lora adapter '{name}' has already been loaded.")
        lora = self._add(LoRARequest(name, self._new_id(), path, base_model_name), in_use or Counter())
        self._pinned.add(name)
        return lora

    def unload(self, name: str, in_use: Counter[int]) -> LoRARequest:
        """Unloads an adapter no request uses; raises LoRANotFound, or LoRAInUse (nothing changes)."""
        if self.config is None:
            raise LoRAAdapterError(NOT_ENABLED)
        lora = self._by_name.get(name)
        if lora is None:
            raise LoRANotFound(f"The lora adapter '{name}' cannot be found.")
        if in_use[lora.lora_int_id]:
            raise LoRAInUse(f"The lora adapter '{name}' has {in_use[lora.lora_int_id]} running or waiting "
                            "request(s); unload it once they finish.")
        self._remove(lora)
        return lora

    def for_request(self, lora: LoRARequest, in_use: Counter[int]) -> int:
        """The id a request naming `lora` runs with: the loaded adapter of that name, else `lora`
        loaded now (not pinned). Raises LoRAAdapterError."""
        if self.config is None:
            raise LoRAAdapterError(NOT_ENABLED)
        loaded = self._by_name.get(lora.lora_name)
        if loaded is not None:
            if loaded.lora_path != lora.lora_path:
                raise LoRAAdapterError(f"the lora adapter '{lora.lora_name}' is loaded from {loaded.lora_path!r}, "
                                       f"not {lora.lora_path!r}")
            self._by_name[lora.lora_name] = self._by_name.pop(lora.lora_name)  # most recently used
            return loaded.lora_int_id
        taken = {a.lora_int_id for a in self._by_name.values()}
        if lora.lora_int_id in taken:
            lora = LoRARequest(lora.lora_name, self._new_id(), lora.lora_path, lora.base_model_name)
        return self._add(lora, in_use).lora_int_id

    def _add(self, lora: LoRARequest, in_use: Counter[int]) -> LoRARequest:
        assert self.config is not None
        if len(self._by_name) >= self.config.cpu_capacity:
            victim = next((a for a in self._by_name.values()
                           if a.lora_name not in self._pinned and not in_use[a.lora_int_id]), None)
            if victim is None:
                raise LoRAAdapterError(
                    f"cannot load the lora adapter '{lora.lora_name}': {len(self._by_name)} adapters are loaded, "
                    f"as many as --max-cpu-loras ({self.config.cpu_capacity}) allows; unload one first")
            self._remove(victim)
        add = getattr(self.executor, "add_lora", None)
        if add is None:
            raise LoRAAdapterError("this engine's model runner cannot load LoRA adapters")
        try:
            add(lora)
        except LoRAAdapterError:
            raise
        except Exception as exc:  # the runner's own failure: this load fails, the engine goes on
            logger.exception("loading the lora adapter %r failed", lora.lora_name)
            raise LoRAAdapterError(f"the lora adapter '{lora.lora_name}' could not be loaded: {exc}") from exc
        self._by_name[lora.lora_name] = lora
        self._next_id = max(self._next_id, lora.lora_int_id + 1)
        logger.info("loaded the lora adapter %r (id %d) from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
        return lora

    def _remove(self, lora: LoRARequest) -> None:
        del self._by_name[lora.lora_name]
        self._pinned.discard(lora.lora_name)
        remove = getattr(self.executor, "remove_lora", None)
        if remove is not None:
            remove(lora.lora_int_id)
        logger.info("unloaded the lora adapter %r (id %d)", lora.lora_name, lora.lora_int_id)

    def _new_id(self) -> int:
        taken = {a.lora_int_id for a in self._by_name.values()}
        while self._next_id in taken:
            self._next_id += 1
        return self._next_id

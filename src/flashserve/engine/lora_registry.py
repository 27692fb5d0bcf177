"""The engine core's LoRA adapters: which are loaded, under which ids, and the executor's
`add_lora` / `remove_lora` behind them.

Adapters come three ways: `--lora-modules` at start, `POST /v1/load_lora_adapter` while serving,
and a request that names an adapter not loaded yet (`LLM.generate(lora_request=...)`), which loads
it on the way in; each stays until unloaded. The runner keeps the weights of `max_cpu_loras` of
them in host memory and reads the others again when a step needs them (`lora/manager.py`). An
adapter is unloaded only when no request (running or waiting) uses it: unloading one in use is
refused, so a running stream never loses its adapter. Ids are never given twice, so the prefix
cache's pages of an unloaded adapter never answer for another (`engine/prefix_cache.py`)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Protocol

from flashserve.config import LoRAConfig
from flashserve.message.lora import LoRAAdapterError, LoRAInUse, LoRANotFound, LoRARequest

logger = logging.getLogger(__name__)


class LoRAExecutor(Protocol):
    def add_lora(self, lora: LoRARequest) -> None:
        """Loads and checks the adapter on every rank; raises LoRAAdapterError."""
        ...

    def remove_lora(self, lora_int_id: int) -> bool: ...


NOT_ENABLED = "LoRA adapters are not enabled: start the server with --enable-lora (LLM: enable_lora=True)"


class LoRARegistry:
    def __init__(self, executor: Any, config: LoRAConfig | None) -> None:
        """`config`: None when LoRA is off (every load is refused then)."""
        self.executor = executor
        self.config = config
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    @property
    def enabled(self) -> bool:
        return self.config is not None

    @property
    def adapters(self) -> tuple[LoRARequest, ...]:
        """The loaded adapters, in the order they loaded."""
        return tuple(self._by_name.values())

    def name_of(self, lora_int_id: int) -> str | None:
        return next((lora.lora_name for lora in self._by_name.values() if lora.lora_int_id == lora_int_id), None)

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Loads an adapter under a new id; raises LoRAAdapterError (a name loaded already, an
        adapter the runner refuses)."""
        if self.config is None:
            raise LoRAAdapterError(NOT_ENABLED)
        if name in self._by_name:
            raise LoRAAdapterError(f"The lora adapter '{name}' has already been loaded.")
        return self._add(LoRARequest(name, self._new_id(), path, base_model_name))

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

    def for_request(self, lora: LoRARequest) -> int:
        """The id a request naming `lora` runs with: the loaded adapter of that name, else `lora`
        loaded now (under its own id, or a new one where that is taken). Raises LoRAAdapterError."""
        if self.config is None:
            raise LoRAAdapterError(NOT_ENABLED)
        loaded = self._by_name.get(lora.lora_name)
        if loaded is not None:
            if loaded.lora_path != lora.lora_path:
                raise LoRAAdapterError(f"the lora adapter '{lora.lora_name}' is loaded from {loaded.lora_path!r}, "
                                       f"not {lora.lora_path!r}")
            return loaded.lora_int_id
        if lora.lora_int_id < self._next_id:  # possibly given before: never reused
            lora = LoRARequest(lora.lora_name, self._new_id(), lora.lora_path, lora.base_model_name)
        return self._add(lora).lora_int_id

    def _add(self, lora: LoRARequest) -> LoRARequest:
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
        remove = getattr(self.executor, "remove_lora", None)
        if remove is not None:
            remove(lora.lora_int_id)
        logger.info("unloaded the lora adapter %r (id %d)", lora.lora_name, lora.lora_int_id)

    def _new_id(self) -> int:
        """Above every id given so far (`_add` moves `_next_id` past each)."""
        return self._next_id

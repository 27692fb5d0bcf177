"""The runner's adapters: those added, a host cache of their weights, and the device slots.

`add` reads and checks an adapter (`adapter.load_adapter`, which raises LoRAAdapterError) and
keeps its weights in a host cache of up to `max_cpu_loras` adapters, least recently used out
first; an added adapter whose weights left the cache is read again from its path when a step
needs it. `slots_for` places the adapters one step uses into the `max_loras` device slots of the
model's `LoRAStack`, reusing the slots they hold and evicting the least recently used adapters
that the step does not use. `remove` forgets an adapter everywhere.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from flashserve.lora.adapter import LoRAAdapter, load_adapter
from flashserve.lora.layers import LoRAStack
from flashserve.message.lora import LoRAAdapterError, LoRARequest

logger = logging.getLogger(__name__)

__all__ = ["LoRAManager", "enable_lora"]


class LoRAManager:
    """`spec`: the whole model's `LlamaSpec` (adapters are checked against it)."""

    def __init__(self, stack: LoRAStack, spec: Any, max_cpu_loras: int) -> None:
        self.stack = stack
        self.spec = spec
        self.max_cpu_loras = max(max_cpu_loras, stack.num_slots)
        self.requests: dict[int, LoRARequest] = {}
        self.cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free_slots = list(range(stack.num_slots))

    def add(self, lora: LoRARequest) -> None:
        """Loads and checks `lora`; an id added before is replaced (its slot is written again
        when a step next uses it). Raises LoRAAdapterError, leaving the adapters as they were."""
        adapter = load_adapter(lora, self.spec, self.stack.max_rank)
        lid = lora.lora_int_id
        self._free_slot_of(lid)
        self.requests[lid] = lora
        self._cache(adapter)
        logger.info("LoRA adapter %r (id %d) loaded from %s: rank %d, %d modules, %.1f MB", lora.lora_name, lid,
                    lora.lora_path, adapter.rank, len(adapter.weights), adapter.nbytes / 1e6)  # fmt: skip

    def remove(self, lora_int_id: int) -> bool:
        """Forgets the adapter; False when it was not added."""
        if self.requests.pop(lora_int_id, None) is None:
            return False
        self.cache.pop(lora_int_id, None)
        self._free_slot_of(lora_int_id)
        return True

    def ids(self) -> set[int]:
        return set(self.requests)

    def slots_for(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """The device slot of each adapter id (0, the base model, excluded) one step uses, placing
        those not resident. Raises LoRAAdapterError for an id never added or for more distinct
        adapters than slots."""
        wanted = list(dict.fromkeys(i for i in lora_ids if i))
        if len(wanted) > self.stack.num_slots:
            raise LoRAAdapterError(f"a step uses {len(wanted)} LoRA adapters; --max-loras is {self.stack.num_slots}")
        for lid in wanted:
            if lid not in self.requests:
                raise LoRAAdapterError(f"a step uses LoRA adapter id {lid}, which was not loaded")
        placed: dict[int, int] = {}
        for lid in wanted:
            slot = self.slot_of.get(lid)
            if slot is None:
                slot = self._take_slot(set(wanted))
                self.stack.write_slot(slot, self._adapter(lid))
            self.slot_of[lid] = slot
            self.slot_of.move_to_end(lid)
            placed[lid] = slot
        return placed

    def _take_slot(self, keep: set[int]) -> int:
        if self.free_slots:
            return self.free_slots.pop(0)
        for lid in self.slot_of:  # least recently used first
            if lid not in keep:
                return self.slot_of.pop(lid)
        raise AssertionError("no slot to evict: slots_for checks the step's adapters against the slots")

    def _free_slot_of(self, lid: int) -> None:
        slot = self.slot_of.pop(lid, None)
        if slot is not None:  # no token names it any more; the next adapter placed there overwrites it
            self.free_slots.append(slot)

    def _adapter(self, lid: int) -> LoRAAdapter:
        adapter = self.cache.get(lid)
        if adapter is None:  # left the host cache: read again
            adapter = load_adapter(self.requests[lid], self.spec, self.stack.max_rank)
            self._cache(adapter)
        else:
            self.cache.move_to_end(lid)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.cache[adapter.lora_int_id] = adapter
        self.cache.move_to_end(adapter.lora_int_id)
        while len(self.cache) > self.max_cpu_loras:
            self.cache.popitem(last=False)


def enable_lora(model: Any, config: Any) -> LoRAManager:
    """Gives `model` (the runner's `StepModel`) device slots for `config`'s adapters (a
    `config.LoRAConfig`) and returns the manager of them. Raises ValueError for a model the
    adapters cannot run on: the generic (transformers) path."""
    native = getattr(model, "model", None)  # the native path's LlamaModel has a spec and a LoRA hook
    if getattr(native, "spec", None) is None or not hasattr(native, "lora"):
        raise ValueError("--enable-lora needs the native model path (a Llama-family model: Llama, Mistral, Qwen2/3, "
                         "SmolLM); this model runs on the generic transformers path")  # fmt: skip
    weight = native.embed_tokens["weight"]
    stack = LoRAStack(native.spec, native.shard, config.max_loras, config.max_lora_rank, weight.dtype, weight.device)
    native.lora = stack
    if max(stack.triton_rows.values()):  # a GPU's decode steps: the shrink joins each projection's GEMM
        stack.fuse_shrink(native.layers)
    return LoRAManager(stack, native.spec, config.cpu_capacity)

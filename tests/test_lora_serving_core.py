"""LoRA adapters between the front ends and the engine core, in one process over the real pipes
(`CoreThread`) with a scripted executor: loads and unloads travel to the core and back, every front
end hears the adapters, a request runs with the id its engine core gave the adapter, and an adapter
with a running request is not unloaded."""

from __future__ import annotations

import asyncio
import time

import pytest

from test_engine import ScriptedExecutor, make_engine
from test_engine_core import CoreThread, soon

from flashserve.config import LoRAConfig
from flashserve.engine.lora_registry import LoRARegistry
from flashserve.engine.outputs import SchedulerOutput
from flashserve.message.lora import LoRAAdapterError, LoRAInUse, LoRARequest
from flashserve.message.sampling_params import SamplingParams


class LoRAExecutor(ScriptedExecutor):
    """Records the adapter ids of every step's rows; refuses adapters whose path says so; each step
    takes `step_seconds`."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(script)
        self.row_loras: set[int] = set()
        self.loaded: set[int] = set()
        self.step_seconds = 0.0

    def add_lora(self, lora: LoRARequest) -> None:
        if "bad" in lora.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: adapter_config.json is missing in {lora.lora_path}")
        self.loaded.add(lora.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.loaded.discard(lora_int_id) is None

    def launch(self, out: SchedulerOutput, previous=None):
        time.sleep(self.step_seconds)
        self.row_loras.update(r.lora_int_id for r in out.requests)
        return super().launch(out, previous)


def lora_core(n: int = 1) -> CoreThread:
    engine = make_engine([3] * 40)
    engine.executor = executor = LoRAExecutor([3] * 40)
    engine.loras = LoRARegistry(executor, LoRAConfig(max_loras=2))
    return CoreThread(engine, n)


async def _drain(stream) -> list:
    return [out async for out in stream]


def test_every_front_end_hears_an_adapter_loaded_through_one_of_them() -> None:
    async def main() -> None:
        core = lora_core(n=2)
        first, second = core.clients()
        await first.load_lora_adapter("sql", "/adapters/sql")
        assert first.lora_adapters["sql"].lora_int_id == 1  # in the asker's list when its call returns
        assert await soon(lambda: "sql" in second.lora_adapters)
        for client in (first, second):
            client.shutdown()

    asyncio.run(main())


def test_a_request_runs_with_the_id_its_engine_core_gave_the_adapter() -> None:
    async def main() -> None:
        core = lora_core()
        (client,) = core.clients()
        await client.load_lora_adapter("sql", "/adapters/sql")
        # The front end's id is not the engine core's (under data parallelism each core gives its own).
        outs = await _drain(client.generate("r", [1, 2], SamplingParams(max_tokens=3),
                                            lora_request=LoRARequest("sql", 77, "/adapters/sql")))
        assert outs[-1].finish_reason == "length"
        assert core.engine.executor.row_loras == {1}
        client.shutdown()

    asyncio.run(main())


def test_an_adapter_the_runner_refuses_is_the_loads_error_and_the_core_serves_on() -> None:
    async def main() -> None:
        core = lora_core()
        (client,) = core.clients()
        with pytest.raises(LoRAAdapterError, match="adapter_config.json is missing in /bad"):
            await client.load_lora_adapter("broken", "/bad")
        assert "broken" not in client.lora_adapters
        outs = await _drain(client.generate("r", [1, 2], SamplingParams(max_tokens=2)))
        assert outs[-1].finish_reason == "length"
        client.shutdown()

    asyncio.run(main())


def test_an_adapter_with_a_running_request_is_not_unloaded_until_it_ends() -> None:
    async def main() -> None:
        core = lora_core()
        (client,) = core.clients()
        await client.load_lora_adapter("sql", "/adapters/sql")
        core.engine.executor.step_seconds = 0.02  # the request runs for a second or more
        stream = client.generate("r", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True),
                                 lora_request=client.lora_adapters["sql"])
        first = await stream.__anext__()
        with pytest.raises(LoRAInUse, match="1 running or waiting"):
            await client.unload_lora_adapter("sql")
        rest = await _drain(stream)
        assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) == 50  # not cut short
        await client.unload_lora_adapter("sql")
        assert "sql" not in client.lora_adapters and core.engine.executor.loaded == set()
        client.shutdown()

    asyncio.run(main())

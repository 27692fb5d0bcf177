"""LoRA adapters in the engine, without a model: the prefix cache keys pages by adapter, KV cache
events name the adapter, the scheduler runs at most `max_loras` adapters at once, and the engine
core's registry loads and unloads adapters through the executor."""

from __future__ import annotations

from collections import Counter

import pytest

from flashserve.config import LoRAConfig
from flashserve.engine.kv_events import to_wire
from flashserve.engine.lora_registry import LoRARegistry
from flashserve.engine.request import Request
from flashserve.kv_cache.events import PagesStored
from flashserve.message.lora import LoRAAdapterError, LoRAInUse, LoRANotFound, LoRARequest
from flashserve.message.sampling_params import SamplingParams
from test_scheduler import make, run, step

PAGE = 16
PROMPT = list(range(100, 140))  # two full pages and a part


def lora_req(rid: str, lora: int, tokens: list[int] = PROMPT, max_tokens: int = 2) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), lora_int_id=lora)


def cached_tokens_of(lora_first: int, lora_second: int) -> int:
    s = make(max_tokens_per_step=512, caching=True)
    s.add_request(lora_req("a", lora_first))
    run(s)
    s.add_request(lora_req("b", lora_second))
    out, _ = step(s)
    return next(r.num_computed_tokens for r in out.requests if r.request_id == "b")


def test_one_adapter_reuses_its_own_cached_pages() -> None:
    assert cached_tokens_of(1, 1) == 2 * PAGE


def test_two_adapters_never_share_cached_pages_for_the_same_prompt() -> None:
    assert cached_tokens_of(1, 2) == 0


def test_an_adapter_never_shares_cached_pages_with_the_base_model() -> None:
    assert cached_tokens_of(0, 1) == 0
    assert cached_tokens_of(1, 0) == 0


def test_every_row_of_a_step_names_its_adapter() -> None:
    s = make(max_tokens_per_step=512)
    s.add_request(lora_req("a", 3, max_tokens=3))
    s.add_request(lora_req("b", 0, max_tokens=3))
    rows = [(r.request_id, r.lora_int_id, r.is_new) for out in run(s) for r in out.requests]
    assert {(rid, lora) for rid, lora, _ in rows} == {("a", 3), ("b", 0)}
    assert any(not new for _, _, new in rows)  # the diff rows too


def test_requests_of_more_adapters_than_max_loras_wait_and_all_finish() -> None:
    s = make(max_tokens_per_step=512)
    s.max_loras = 2
    for i, lora in enumerate([1, 2, 3, 1, 0, 3]):
        s.add_request(lora_req(f"r{i}", lora, tokens=list(range(10 + i, 30 + i)), max_tokens=3))
    outs = run(s)
    for out in outs:
        assert len({r.lora_int_id for r in out.requests} - {0}) <= 2
    first = {r.request_id for r in outs[0].requests}
    assert first == {"r0", "r1", "r3", "r4"}  # adapter 3 waits for a slot; the base model never does
    assert any(r.request_id == "r2" for out in outs for r in out.requests)  # and runs later


def test_stored_pages_name_their_adapter_as_vllm_does() -> None:
    events = [PagesStored([b"a" * 32], None, list(range(PAGE)), None, lora_id=4),
              PagesStored([b"b" * 32], None, list(range(PAGE)), None)]
    adapter, base = to_wire(events, PAGE, lora_names={4: "sql"})
    assert (adapter.lora_id, adapter.lora_name) == (4, "sql")
    assert (base.lora_id, base.lora_name) == (None, None)


def test_cached_pages_of_an_adapter_are_stored_with_its_id() -> None:
    s = make(max_tokens_per_step=512, caching=True)
    s.kv_cache.record_events()
    s.add_request(lora_req("a", 5))
    run(s)
    stored = [e for e in s.kv_cache.take_events() if isinstance(e, PagesStored)]
    assert stored and all(e.lora_id == 5 for e in stored)


# ---- the engine core's registry -----------------------------------------------------------------
class FakeExecutor:
    def __init__(self, refuse: str | None = None) -> None:
        self.loaded: dict[int, LoRARequest] = {}
        self.refuse = refuse

    def add_lora(self, lora: LoRARequest) -> None:
        if self.refuse:
            raise LoRAAdapterError(self.refuse)
        self.loaded[lora.lora_int_id] = lora

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.loaded.pop(lora_int_id, None) is not None


def registry(executor: FakeExecutor | None = None) -> LoRARegistry:
    return LoRARegistry(executor or FakeExecutor(), LoRAConfig(max_loras=1))


def test_a_loaded_adapter_gets_a_fresh_id_and_reaches_the_executor() -> None:
    executor = FakeExecutor()
    r = registry(executor=executor)
    a, b = r.load("a", "/a"), r.load("b", "/b", "base")
    assert (a.lora_int_id, b.lora_int_id) == (1, 2) and b.base_model_name == "base"
    assert set(executor.loaded) == {1, 2}


def test_ids_are_never_reused_after_an_unload() -> None:
    r = registry()
    first = r.load("a", "/a")
    r.unload("a", Counter())
    assert r.load("a", "/a").lora_int_id != first.lora_int_id


def test_loading_a_name_twice_is_refused_as_vllm_does() -> None:
    r = registry()
    r.load("a", "/a")
    with pytest.raises(LoRAAdapterError, match="has already been loaded"):
        r.load("a", "/other")


def test_the_runners_refusal_is_the_loads_error_and_nothing_is_registered() -> None:
    r = registry(executor=FakeExecutor(refuse="adapter 'a': rank 64 exceeds --max-lora-rank 16"))
    with pytest.raises(LoRAAdapterError, match="rank 64"):
        r.load("a", "/a")
    assert r.adapters == ()


def test_unloading_an_unknown_adapter_is_not_found() -> None:
    with pytest.raises(LoRANotFound, match="cannot be found"):
        registry().unload("nope", Counter())


def test_unloading_an_adapter_with_requests_is_refused_and_keeps_it() -> None:
    r = registry()
    a = r.load("a", "/a")
    with pytest.raises(LoRAInUse, match="1 running or waiting"):
        r.unload("a", Counter({a.lora_int_id: 1}))
    assert r.adapters == (a,)


def test_a_requests_own_adapter_loads_on_the_way_in_and_keeps_its_name() -> None:
    executor = FakeExecutor()
    r = registry(executor=executor)
    assert r.for_request(LoRARequest("x", 7, "/x")) == 7
    assert r.for_request(LoRARequest("x", 7, "/x")) == 7  # loaded once
    assert set(executor.loaded) == {7}
    with pytest.raises(LoRAAdapterError, match="is loaded from '/x'"):
        r.for_request(LoRARequest("x", 7, "/elsewhere"))


def test_an_id_given_before_goes_to_no_other_adapter() -> None:
    r = registry()
    r.load("a", "/a")  # id 1
    r.unload("a", Counter())
    assert r.for_request(LoRARequest("b", 1, "/b")) != 1


def test_without_enable_lora_every_load_is_refused() -> None:
    r = LoRARegistry(FakeExecutor(), None)
    with pytest.raises(LoRAAdapterError, match="--enable-lora"):
        r.load("a", "/a")

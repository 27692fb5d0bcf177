"""LoRA adapters in the HTTP API over a fake engine: a request names an adapter as its model on every
endpoint, /v1/models lists adapters with root and parent, and the runtime load / unload endpoints
answer in vLLM's shapes (only when runtime updates are allowed, and behind --api-key)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from fake_engine import MODEL, FakeEngine
from flashserve.api.options import APIOptions
from flashserve.api.server import build_app
from flashserve.message.lora import LoRAAdapterError, LoRAInUse, LoRANotFound, LoRARequest
from flashserve.message.outputs import RequestOutput
from flashserve.message.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

SQL = LoRARequest("sql", 1, "/adapters/sql")
KEY = "sekret"


class FakeLoRAEngine(FakeEngine):
    """A FakeEngine that serves adapters: it records each request's adapter and loads or unloads
    as told (`refuse`: the error its next load or unload raises)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.lora_enabled = True
        self.lora_adapters: dict[str, LoRARequest] = {SQL.lora_name: SQL}
        self.loras: dict[str, LoRARequest | None] = {}
        self.refuse: Exception | None = None

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       group: str | None = None, cache_salt: str | None = None, stream: bool = True,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        self.loras[request_id] = lora_request
        async for out in super().generate(request_id, prompt_token_ids, params, group, cache_salt, stream):
            yield out

    async def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.lora_adapters[lora_name] = LoRARequest(lora_name, len(self.lora_adapters) + 1, lora_path, base_model_name)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        if self.refuse is not None:
            raise self.refuse
        if self.lora_adapters.pop(lora_name, None) is None:
            raise LoRANotFound(f"The lora adapter '{lora_name}' cannot be found.")


def client(engine: FakeEngine, tokenizer: Any, **options: Any) -> httpx.AsyncClient:
    opts = APIOptions(**{"allow_runtime_lora_updating": True, **options})
    app = build_app(engine, tokenizer, [MODEL], 2048, options=opts)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def post(engine: FakeEngine, tokenizer: Any, path: str, body: Any, **options: Any) -> httpx.Response:
    async with client(engine, tokenizer, **options) as c:
        return await c.post(path, json=body)


def only_lora(engine: FakeLoRAEngine) -> LoRARequest | None:
    (lora,) = set(engine.loras.values())
    return lora


# ---- a request names its adapter as its model -----------------------------------------------------
async def test_a_chat_completion_naming_an_adapter_runs_with_it_and_answers_as_it(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    r = await post(engine, tokenizer, "/v1/chat/completions",
                   {"model": "sql", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert only_lora(engine) == SQL  # every choice


async def test_a_completion_naming_an_adapter_runs_with_it(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    r = await post(engine, tokenizer, "/v1/completions", {"model": "sql", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert only_lora(engine) == SQL


async def test_a_request_naming_the_base_model_runs_without_an_adapter(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    r = await post(engine, tokenizer, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert only_lora(engine) is None


async def test_responses_and_messages_naming_an_adapter_run_with_it(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    r = await post(engine, tokenizer, "/v1/responses", {"model": "sql", "input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    r = await post(engine, tokenizer, "/v1/messages",
                   {"model": "sql", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert only_lora(engine) == SQL


async def test_tokenize_takes_an_adapter_as_its_model(tokenizer: Any) -> None:
    r = await post(FakeLoRAEngine(), tokenizer, "/tokenize", {"model": "sql", "prompt": "Hi"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer.encode("Hi")


async def test_an_unknown_model_is_a_404_in_openais_shape_naming_it(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    r = await post(engine, tokenizer, "/v1/completions", {"model": "nope", "prompt": "Hi"})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model `nope` does not exist.", "type": "invalid_request_error",
                                 "param": "model", "code": "model_not_found"}
    assert engine.loras == {}


# ---- /v1/models ------------------------------------------------------------------------------------
async def test_models_lists_each_adapter_with_its_path_as_root_and_the_base_as_parent(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    engine.lora_adapters["fr"] = LoRARequest("fr", 2, "/adapters/fr", base_model_name="other-base")
    async with client(engine, tokenizer) as c:
        cards = {card["id"]: card for card in (await c.get("/v1/models")).json()["data"]}
        one = (await c.get("/v1/models/sql")).json()
    assert (cards[MODEL]["root"], cards[MODEL]["parent"]) == (MODEL, None)  # as vLLM lists a base model
    assert (cards["sql"]["root"], cards["sql"]["parent"]) == ("/adapters/sql", MODEL)
    assert cards["fr"]["parent"] == "other-base"
    assert one["id"] == "sql" and one["parent"] == MODEL


# ---- runtime loading ---------------------------------------------------------------------------------
async def test_loading_an_adapter_answers_vllms_text_and_lists_it(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    async with client(engine, tokenizer) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "fr", "lora_path": "/adapters/fr"})
        ids = [card["id"] for card in (await c.get("/v1/models")).json()["data"]]
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'fr' added successfully."
    assert "fr" in ids


async def test_unloading_an_adapter_answers_vllms_text_and_unlists_it(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    async with client(engine, tokenizer) as c:
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        ids = [card["id"] for card in (await c.get("/v1/models")).json()["data"]]
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'sql' removed successfully."
    assert "sql" not in ids


async def test_a_load_without_name_or_path_is_a_400(tokenizer: Any) -> None:
    r = await post(FakeLoRAEngine(), tokenizer, "/v1/load_lora_adapter", {"lora_name": "fr"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."


async def test_loading_a_name_loaded_already_is_a_400(tokenizer: Any) -> None:
    r = await post(FakeLoRAEngine(), tokenizer, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "The lora adapter 'sql' has already been loaded."


async def test_an_adapter_the_runner_refuses_is_a_400_with_its_message(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    engine.refuse = LoRAAdapterError("LoRA adapter 'fr': rank 64 exceeds --max-lora-rank 16")
    r = await post(engine, tokenizer, "/v1/load_lora_adapter", {"lora_name": "fr", "lora_path": "/adapters/fr"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == "LoRA adapter 'fr': rank 64 exceeds --max-lora-rank 16"
    assert error["type"] == "invalid_request_error"


async def test_unloading_an_unknown_adapter_is_a_404(tokenizer: Any) -> None:
    r = await post(FakeLoRAEngine(), tokenizer, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."


async def test_unloading_an_adapter_with_requests_is_a_409(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    engine.refuse = LoRAInUse("The lora adapter 'sql' has 2 running or waiting request(s); unload it once they finish.")
    r = await post(engine, tokenizer, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "lora_adapter_in_use"


async def test_the_load_endpoints_are_not_served_without_runtime_updates(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = await post(engine, tokenizer, path, {"lora_name": "fr", "lora_path": "/x"},
                       allow_runtime_lora_updating=False)
        assert r.status_code == 404
    assert "fr" not in engine.lora_adapters


async def test_the_load_endpoints_need_the_api_key_when_one_is_set(tokenizer: Any) -> None:
    engine = FakeLoRAEngine()
    body = {"lora_name": "fr", "lora_path": "/x"}
    async with client(engine, tokenizer, api_keys=(KEY,)) as c:
        refused = await c.post("/v1/load_lora_adapter", json=body)
        accepted = await c.post("/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 401
    assert accepted.status_code == 200

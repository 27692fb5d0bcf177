"""LoRA adapters in the API: a request names an adapter as its `model`, `/v1/models` lists the
adapters (`root`: where each was loaded from, `parent`: its base model), and with
`--allow-runtime-lora-updating` (vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) `POST
/v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` load and unload adapters while serving,
in vLLM's shapes: a plain-text success, or an error in OpenAI's shape (400 for an adapter that does
not load or a name loaded already, 404 for an unknown name, 409 for an adapter that still has
running or waiting requests, which stays loaded).

The engine core owns the adapters; the engine client (`client/core_client.py`) keeps the list it
last heard, which is what requests are resolved against here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from flashserve.api.errors import NOT_FOUND, APIError, engine_dead, invalid
from flashserve.message.errors import EngineDead
from flashserve.message.lora import LoRAAdapterError, LoRAInUse, LoRANotFound, LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_int_id: int | None = None  # vLLM's field; adapters are unloaded by name here


def model_not_found(model: str) -> APIError:
    """OpenAI's answer to an unknown model (its type is invalid_request_error, as OpenAI's)."""
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def lora_adapters(engine: Any) -> Mapping[str, LoRARequest]:
    """The engine's adapters by name; none for an engine without LoRA (a test's fake, say)."""
    return getattr(engine, "lora_adapters", None) or {}


def resolve_model(engine: Any, served_names: list[str], model: str | None) -> tuple[str, LoRARequest | None]:
    """The model a request names (None: the first served name) and its LoRA adapter (None for
    the base model); raises the 404 of an unknown model."""
    if model is None:
        return served_names[0], None
    if model in served_names:
        return model, None
    lora = lora_adapters(engine).get(model)
    if lora is None:
        raise model_not_found(model)
    return model, lora


def adapter_cards(engine: Any, base_name: str) -> list[dict[str, Any]]:
    """What `/v1/models` shows of each adapter besides its id: `root` (its path) and `parent` (its
    base model)."""
    return [{"id": lora.lora_name, "root": lora.lora_path, "parent": lora.base_model_name or base_name}
            for lora in lora_adapters(engine).values()]


class LoRAServing:
    """The runtime load and unload endpoints (`--allow-runtime-lora-updating`)."""

    def __init__(self, engine: Any, served_names: list[str]) -> None:
        self.engine = engine
        self.served_names = served_names

    async def load(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if not body.lora_name or not body.lora_path:
            raise invalid("Both 'lora_name' and 'lora_path' must be provided.",
                          "lora_name" if not body.lora_name else "lora_path")
        if body.lora_name in self.served_names:
            raise invalid(f"'{body.lora_name}' is the base model's name; name the adapter otherwise", "lora_name")
        if body.lora_name in lora_adapters(self.engine):
            raise invalid(f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        await self._call(self._client().load_lora_adapter(body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if not body.lora_name:
            raise invalid("'lora_name' must be provided.", "lora_name")
        await self._call(self._client().unload_lora_adapter(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _client(self) -> Any:
        if not hasattr(self.engine, "load_lora_adapter"):
            raise invalid("this server's engine does not serve LoRA adapters")
        return self.engine

    @staticmethod
    async def _call(call: Any) -> None:
        try:
            await call
        except LoRANotFound as exc:
            raise APIError(404, str(exc), NOT_FOUND, "lora_name", "lora_adapter_not_found") from None
        except LoRAInUse as exc:
            raise APIError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from None
        except LoRAAdapterError as exc:
            raise invalid(str(exc), "lora_path", code="invalid_lora_adapter") from None
        except EngineDead as exc:
            raise engine_dead(str(exc)) from None

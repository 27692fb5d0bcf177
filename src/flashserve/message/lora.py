"""A LoRA adapter as it travels: what a request names, what the engine core loads, and why a load
fails.

A request's adapter crosses the pipe inside its `AddRequest` (msgspec encodes the frozen
dataclass as it does the rest of the message); each step's rows then name it by `lora_int_id`
alone (0 is the base model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter: `lora_name` is the model id requests use, `lora_int_id` (>= 1) the number the
    engine and the runner know it by, `lora_path` its folder (PEFT's `adapter_config.json` and
    `adapter_model.safetensors`) or an HF id found in the local cache. `base_model_name`: the model
    `/v1/models` lists as its parent; None: the served base model."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


class LoRAAdapterError(ValueError):
    """An adapter cannot be loaded or served; the message says which adapter and what is wrong
    (missing or corrupt files, a rank over --max-lora-rank, shapes or target modules that do not
    fit the base model), in words a user can act on."""


class LoRANotFound(LoRAAdapterError):
    """No adapter of that name is loaded (HTTP 404)."""


class LoRAInUse(LoRAAdapterError):
    """The adapter has running or waiting requests, so it stays loaded (HTTP 409)."""


LORA_ERRORS: dict[str, type[LoRAAdapterError]] = {
    cls.__name__: cls for cls in (LoRAAdapterError, LoRANotFound, LoRAInUse)
}  # by name, as an engine core's answer names them

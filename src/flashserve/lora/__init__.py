"""LoRA adapters on the native model: PEFT adapters read and checked on the host
(`adapter.py`), applied beside the fused projections from device slots (`layers.py`), and the
runner's bookkeeping of adapters, host cache and slots (`manager.py`)."""

from flashserve.lora.adapter import LoRAAdapter, load_adapter
from flashserve.lora.layers import LoRAStack
from flashserve.lora.manager import LoRAManager
from flashserve.message.lora import LoRAAdapterError, LoRARequest

__all__ = ["LoRAAdapter", "LoRAAdapterError", "LoRAManager", "LoRARequest", "LoRAStack", "load_adapter"]

"""flashserve: an OpenAI-compatible LLM inference server.

`from flashserve import LLM, SamplingParams` gives the offline API; both are imported on first use,
so that `flashserve --help` and the front ends do not pay for torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from flashserve.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from flashserve.message.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'flashserve' has no attribute {name!r}")

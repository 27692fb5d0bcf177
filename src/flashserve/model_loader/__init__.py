"""Loading a model from its sources (embedded GGUF, HF id or directory, safetensors, dummy weights), whole or
one tensor-parallel rank's shard."""

from flashserve.model_loader.loader import LoadedModel, load

__all__ = ["LoadedModel", "load"]

"""Model definitions: the native Llama-family forward and the generic transformers wrapper."""

"""Sampling from logits (PyTorch and FlashInfer) and log-probabilities."""

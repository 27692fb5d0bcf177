"""Compute layers below the models: projections in their weight formats (dense, FP8) and FP8 numerics."""

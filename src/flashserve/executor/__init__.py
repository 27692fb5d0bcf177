"""Rank 0's side of tensor parallelism: starting worker ranks, sending them each step, and the workers' loop."""

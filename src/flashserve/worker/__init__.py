"""Torch from here down: the persistent input batch, the runner (launch / collect), CUDA graphs and the step
budget."""

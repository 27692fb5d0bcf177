"""Speculative decoding: proposers of draft tokens, their configuration and acceptance statistics.

Pure Python (no torch): the scheduler asks a proposer for a decoding request's draft tokens, and
the runner verifies them in the same forward as the request's next token (`sample/rejection.py`).
"""

"""Acceptance counts since start, under vLLM's metric names' meanings: what the engine loop turns
into metrics and the benchmark reads (`Scheduler.spec_stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verified rows that carried draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_pos[i]: drafts whose token at position i (0-based) was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified draft row produced on average: its accepted drafts plus the one the
        target always adds (vLLM's "mean acceptance length")."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def acceptance_per_position(self) -> list[float]:
        """Share of drafts accepted at each position (over all drafts, as vLLM reports it)."""
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []

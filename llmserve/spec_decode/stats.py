"""Running totals of speculative decoding, read by /metrics, the periodic log and ``bench``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts k+1 accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [k]: drafts with a k+1-th

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for counts, n in (
            (self.drafted_per_position, num_drafted),
            (self.accepted_per_position, num_accepted),
        ):
            counts.extend([0] * (n - len(counts)))
            for k in range(n):
                counts[k] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def describe(self) -> str:
        per_position = ", ".join(
            f"{a / d:.2f}" for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        )
        return (
            f"speculative decoding: {self.num_drafts} drafts, acceptance rate "
            f"{self.acceptance_rate:.1%}, mean accepted length {self.mean_accepted_length:.2f} "
            f"tokens per step; acceptance by position: [{per_position}]"
        )

"""What the scheduler hands the runner each step (``SchedulerOutput``: which sequences, how
many tokens each) and what comes back to it (``SampledSeq``: a new token per sequence)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.engine.sequence import Sequence
from llmserve.outputs import Logprob


@dataclass
class ScheduledSeq:
    """One sequence in a step: compute ``num_tokens`` tokens from ``seq.num_computed_tokens``."""

    seq: Sequence
    num_tokens: int
    num_samples: int  # 0 mid-prompt, 1 normally, n when this step forks a request
    num_spec_tokens: int = 0  # drafted tokens to verify after the last real one
    spec_token_ids: list[int] | None = None  # n-gram drafts; None: the draft model makes them


@dataclass
class SchedulerOutput:
    """What the runner must do this step. Decodes come first, then prefill chunks."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (block, slot)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (slot, block)
    finished_seq_ids: list[int] = field(default_factory=list)  # runner may drop their state
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class SampledSeq:
    """A sequence that received a new token this step (a fork yields one per child)."""

    seq: Sequence
    token_id: int
    logprobs: dict[int, Logprob] | None
    num_output_tokens: int = 0  # the sequence's output length with this token

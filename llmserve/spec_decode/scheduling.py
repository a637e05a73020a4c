"""The scheduler's side of speculative decoding, torch-free like config.py and ngram.py.

pays(running)           speculate this step? not at large batches (compute-bound there)
schedule(seq, ...)      a decode with K drafts (n-gram ones proposed here), if they fit
accept(item, tokens)    the accepted drafts and the target's token join the sequence;
                        only they count as computed, the blocks past them go back
"""

from __future__ import annotations

from typing import Any

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.scheduler_output import SampledSeq, ScheduledSeq, SchedulerOutput
from llmserve.engine.sequence import Sequence
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.ngram import propose_ngram
from llmserve.spec_decode.stats import SpecDecodeStats


class SpeculativeScheduling:
    """Drafts for the scheduler's decodes, and the rollback after verification."""

    def __init__(
        self, config: SpeculativeConfig, block_manager: BlockManager, stats: SpecDecodeStats
    ):
        self.config, self.block_manager, self.stats = config, block_manager, stats

    def pays(self, running: list[Sequence]) -> bool:
        """Large batches are compute-bound: verifying rejected drafts would cost real time."""
        num_decodes = sum(1 for s in running if s.num_uncomputed_tokens == 1)
        return num_decodes <= self.config.disable_by_batch_size

    def schedule(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        """Schedule ``seq``'s decode with K drafts, if it can take any and they fit now."""
        request = seq.request
        if (
            seq.num_uncomputed_tokens != 1
            or request.num_pending_forks  # its first sample forks the request
            or request.params.use_beam_search
            or seq.grammar is not None  # drafts would need the grammar's rollback
        ):
            return False
        spec = self.config
        # Never draft past max_tokens (which the engine capped at the context's end).
        k = min(
            spec.num_speculative_tokens, request.max_tokens - seq.num_output_tokens - 1, budget - 1
        )
        drafts = None
        if k > 0 and spec.method == "ngram":
            drafts = propose_ngram(seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
            k = len(drafts)
        if k < 1 or not self.block_manager.can_allocate(seq, 1 + k):
            return False  # a plain decode instead (which may preempt to make room)
        self.block_manager.allocate(seq, 1 + k)
        out.scheduled.append(ScheduledSeq(seq, 1 + k, 1, num_spec_tokens=k, spec_token_ids=drafts))
        return True

    def accept(self, item: ScheduledSeq, tokens: list[tuple[int, Any]]) -> list[SampledSeq]:
        """A verified decode: the accepted drafts and the target's token join the sequence;
        only they count as computed, and blocks holding rejected slots go back."""
        seq, num_drafted, num_accepted = item.seq, item.num_spec_tokens, len(tokens) - 1
        start = seq.num_computed_tokens
        seq.num_computed_tokens = start + 1 + num_accepted
        if self.config.uses_draft_model:  # its KV holds the last token and accepted drafts
            seq.draft_num_computed_tokens = start + 1 + min(num_accepted, num_drafted - 1)
        self.block_manager.trim(seq)
        self.block_manager.cache_full_blocks(seq)
        self.stats.record(num_drafted, num_accepted)
        sampled = []
        for token_id, logprobs in tokens:
            seq.token_ids.append(token_id)
            sampled.append(SampledSeq(seq, token_id, logprobs, seq.num_output_tokens))
        return sampled

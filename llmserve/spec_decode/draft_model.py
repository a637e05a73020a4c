"""A draft model proposing K tokens per speculating sequence, on paged KV blocks.

A separate drafter (``"model": PATH``) has its own pool with as many blocks as the target's,
read and written through the *target's* block tables: position p of a sequence lives in the
same block id in both pools. So the scheduler's block manager (allocation, copy-on-write,
prefix caching, preemption) serves both models, and the rollback after a rejection is the
target's. Per step, for the speculating sequences only:

    pass 1      catch up: the tokens the drafter has not computed yet
                (``seq.draft_num_computed_tokens`` .. the last token), for a new sequence its
                whole prompt; the logits at the last token give d1
    pass 2..K   one token each: d_{j} in, d_{j+1} out

The target drafting for itself (no ``model``, its own weights quantized) has the same KV
layout, so it *shares* the target's pool: it reads the target's K/V of every computed
position (no catch-up, no second pool) and writes its own only at the last token and the
draft positions, slots the target's verification overwrites in every layer before it reads
them. Those slots lie past ``num_computed_tokens``, in blocks the sequence owns (the
scheduler copied a shared one on write), and never in the prefix cache.

A drafted token is drawn like the target would draw it (same logit bias, penalties over the
output and the drafts so far, temperature, top-k/top-p/min-p; argmax for greedy rows), and for
sampled rows its distribution q is kept for the rejection sampler.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmserve.runner.inputs import Chunk, build_step_inputs
from llmserve.runner.sampler import SamplingRow, argmax_and_probs, draw_tokens, sampler_kernels

MAX_DECODE_ROWS = 16  # a longer catch-up (a new sequence's prompt) runs as a prefill chunk
Proposal = tuple[list[int], torch.Tensor | None]  # drafts, their q rows [K, vocab] (sampled rows)


class DraftModelProposer:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches,
        block_size: int,
        device: torch.device,
        attention_backend: str,
        shares_target_kv: bool = False,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.shares_target_kv = shares_target_kv
        self.block_size = block_size
        self.device = device
        self.attention_backend = attention_backend

    @torch.inference_mode()
    def propose(self, items: list, make_row: Callable[..., SamplingRow]) -> dict[int, Proposal]:
        """``items``: ScheduledSeqs with ``num_spec_tokens`` > 0; ``make_row(item, drafts)``
        gives the sampling row of the token after ``drafts``. Returns drafts by seq id."""
        drafts: dict[int, list[int]] = {item.seq.seq_id: [] for item in items}
        q_rows: dict[int, list[torch.Tensor]] = {item.seq.seq_id: [] for item in items}
        # Pass 1 catches up: short catch-ups as decode rows, first; prompts as prefills.
        starts = {item.seq.seq_id: self._start(item.seq) for item in items}
        first = sorted(
            items, key=lambda it: it.seq.num_tokens - starts[it.seq.seq_id] > MAX_DECODE_ROWS
        )
        chunks = []
        for item in first:
            seq, start = item.seq, starts[item.seq.seq_id]
            short = seq.num_tokens - start <= MAX_DECODE_ROWS
            chunks.append(Chunk(seq.token_ids[start:], start, seq.block_ids, 1, as_decodes=short))
        self._step(first, chunks, drafts, q_rows, make_row)
        for j in range(1, max(item.num_spec_tokens for item in items)):
            active = [item for item in items if item.num_spec_tokens > j]
            chunks = [
                Chunk([drafts[it.seq.seq_id][-1]], it.seq.num_tokens + j - 1, it.seq.block_ids, 1)
                for it in active
            ]
            self._step(active, chunks, drafts, q_rows, make_row)
        return {
            seq_id: (tokens, torch.stack(q_rows[seq_id]) if q_rows[seq_id] else None)
            for seq_id, tokens in drafts.items()
        }

    def _start(self, seq) -> int:
        """First position the drafter computes: its catch-up, or just the last token."""
        return seq.num_computed_tokens if self.shares_target_kv else seq.draft_num_computed_tokens

    def _step(self, items, chunks, drafts, q_rows, make_row) -> None:
        inputs = build_step_inputs(chunks, self.block_size, self.device, self.attention_backend)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        logits = self.model.compute_logits(inputs.logits_rows(hidden))  # [num_items, vocab]
        rows = [make_row(item, drafts[item.seq.seq_id]) for item in items]
        tokens, probs = draw(logits, rows, sampler_kernels(self.attention_backend))
        for i, item in enumerate(items):
            drafts[item.seq.seq_id].append(tokens[i])
            if probs[i] is not None:
                q_rows[item.seq.seq_id].append(probs[i])


def draw(
    logits: torch.Tensor, rows: list[SamplingRow], kernels: str = "torch"
) -> tuple[list[int], list]:
    """One token per row as the target's sampler would draw it; for sampled rows also the
    normalized distribution it was drawn from."""
    tokens, random_rows, p = argmax_and_probs(logits, rows, kernels)
    probs: list[torch.Tensor | None] = [None] * len(rows)
    if p is not None:
        sampled = draw_tokens(p, [rows[i].generator for i in random_rows]).tolist()
        for k, i in enumerate(random_rows):
            tokens[i], probs[i] = sampled[k], p[k]
    return tokens, probs


def resolve_drafter(spec, target, target_config, max_model_len: int):
    """The drafter's (ResolvedModel, config), checked against the target before any weight
    is read: same vocabulary size, a context at least ``max_model_len`` long."""
    from llmserve.loader import load_config, resolve_model

    if spec.model is None:  # the target itself, quantized as the draft config says
        return target, target_config
    resolved = resolve_model(spec.model)
    config = load_config(resolved)
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"the draft model {spec.model!r} has a vocabulary of {config.vocab_size} tokens but the "
            f"target's has {target_config.vocab_size}; a drafter must share the target's vocabulary"
        )
    draft_len = getattr(config, "max_position_embeddings", None)
    if draft_len is not None and draft_len < max_model_len:
        raise ValueError(
            f"the draft model {spec.model!r} handles {draft_len} positions but the target runs "
            f"sequences of up to {max_model_len} tokens; lower --max-model-len to {draft_len} or "
            "pick a drafter with a longer context"
        )
    return resolved, config

"""Flat step tensors from per-sequence chunks, shared by the model runner and the drafter.

    chunks:       [d0: 1 token] [d1: 1 token] [p0: 3 tokens from 0] [s0: 1 + K tokens from 128]
    input_ids:     t             t             t  t  t               t  d1 .. dK
    positions:     9             3             0  1  2               128 129 ..
    slot_mapping:  block_table[pos // bs] * bs + pos % bs, per token
    logits rows:   the last ``num_logits`` tokens of each chunk (1, or K + 1 to verify drafts)

Chunks of one token must come first: attention treats the first ``num_decodes`` as decodes.
A short chunk marked ``as_decodes`` (drafts to verify, a drafter's catch-up) becomes one
decode row per token, all on the same block table: every layer writes the chunk's K/V before
it attends, so row i, with context ``start + i + 1``, sees exactly the positions up to its
own. The decode kernels then serve it, instead of a prefill's gather and mask per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.layers.attention_metadata import AttentionMetadata
from llmserve.layers.paged_attention_torch import build_plan


@dataclass
class Chunk:
    """Compute ``token_ids`` at positions ``start..`` of a sequence with ``block_ids``."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    num_logits: int  # trailing tokens whose logits are wanted (0 mid-prompt)
    as_decodes: bool = False  # attend as one decode row per token (place it among decodes)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] rows of the hidden states to turn into logits

    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's output ``hidden`` at the logits rows (all it holds when pruned)."""
        return hidden if self.meta.output_rows is not None else hidden[self.logits_indices]


def build_step_inputs(
    chunks: list[Chunk],
    block_size: int,
    device: torch.device,
    attention_backend: str,
    prune_outputs: bool = True,
) -> StepInputs:
    """``prune_outputs``: where fewer rows want logits than the step computes, the model's
    last layer finishes only those rows (``meta.output_rows``); off when every row's hidden
    state is read (prompt logprobs)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    logits_indices: list[int] = []
    bs = block_size
    chunks = [row for chunk in chunks for row in _rows(chunk)]
    for chunk in chunks:
        start, end, table = chunk.start, chunk.start + len(chunk.token_ids), chunk.block_ids
        input_ids.extend(chunk.token_ids)
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        query_start.append(query_start[-1] + len(chunk.token_ids))
        logits_indices.extend(range(query_start[-1] - chunk.num_logits, query_start[-1]))
    query_lens = [len(c.token_ids) for c in chunks]
    seq_lens = [c.start + n for c, n in zip(chunks, query_lens, strict=True)]
    max_blocks = max(len(c.block_ids) for c in chunks)
    tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks]
    meta = AttentionMetadata(
        num_decodes=sum(1 for n in query_lens if n == 1),
        query_start_loc=device_tensor(query_start, torch.int32, device),
        seq_lens=device_tensor(seq_lens, torch.int32, device),
        block_tables=device_tensor(tables, torch.int32, device),
        slot_mapping=device_tensor(slots, torch.int64, device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    if attention_backend in ("torch", "cpp"):
        meta.plan = build_plan(meta, bs, native_decode=attention_backend == "cpp")
    rows = device_tensor(logits_indices, torch.int64, device)
    if prune_outputs and len(logits_indices) < len(input_ids):
        meta.output_rows = rows
    return StepInputs(
        input_ids=device_tensor(input_ids, torch.int64, device),
        positions=device_tensor(positions, torch.int64, device),
        meta=meta,
        logits_indices=rows,
    )


def _rows(chunk: Chunk) -> list[Chunk]:
    if not chunk.as_decodes or len(chunk.token_ids) == 1:
        return [chunk]
    n = len(chunk.token_ids)
    return [
        Chunk([token], chunk.start + i, chunk.block_ids, int(i >= n - chunk.num_logits))
        for i, token in enumerate(chunk.token_ids)
    ]


def device_tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` (copied without waiting; the step's inputs, the
    sampler's indices and parameters)."""
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

"""Per-step attention metadata, built by the model runner and passed explicitly to attention.

Batch layout (decodes first, then prefill chunks), e.g. 2 decodes and 2 prefill chunks:

    tokens:           d0 | d1 | p0 p0 p0 | p1 p1
    query_start_loc:  0    1    2          5      7      (cu_seqlens_q, [num_seqs + 1])
    seq_lens:         9    4    3          130           (context length after this step)

A sequence's new tokens are the *last* ``q_len`` positions of its context: token i of a
chunk sits at position ``seq_len - q_len + i`` and attends to positions 0..that (causal).

KV pool of one layer (K and V alike), and how a block table maps positions to slots:

    k_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables[b] = [7, 2, 9, ...]   position p -> slot block_tables[b][p // block_size]
                                                    * block_size + p % block_size
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's batch."""

    num_decodes: int  # sequences with one query token; they come first in the batch
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, pool slot where each new K/V is written
    max_query_len: int
    max_seq_len: int
    # Host copies, so the torch backend can size its padding without a device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    plan: Any = None  # backend-specific indices built once per step (torch backend)
    # Rows whose hidden states the step reads after the last layer (its logits rows), or None
    # for every row. Past its attention (K/V written for every row), the last layer computes
    # only these: the output projection and MLP of a prompt's other tokens are never read.
    output_rows: torch.Tensor | None = None  # [num_outputs] int64

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

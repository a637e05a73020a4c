"""Tensor parallelism applied to a loaded rank's model (Llama, or any models/decoder.py family),
as a pass after loading.

The model is built from ``plan.local_config`` (this rank's heads, MLP columns and vocabulary
rows) and filled with its cut weights (``weights.py``), so its layers already have the local
shapes:

    qkv_proj, gate_up_proj   column-parallel: local output rows, no communication
    o_proj, down_proj        row-parallel: local input columns; the block's output is summed
                             over ranks (an all-reduce hooked on ``self_attn`` and ``mlp``, so
                             oneDNN packing, which swaps the linears, keeps it)
    experts (MoE)            each expert's gate/up rows and down columns as the dense MLP's;
                             the router is replicated, so every rank routes alike, and the
                             same all-reduce on ``mlp`` sums the experts' partial outputs
    embed_tokens             vocabulary-parallel: rows outside the shard give 0, then all-reduce
    lm_head                  vocabulary-parallel: local logits, all-gathered to the full vocab

Quantized layers (a GGUF file's blocks, GPTQ/AWQ, the run-time methods) arrive already cut to
the rank's share (``weights.py``); the wrappers call whatever layer is there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from llmserve.distributed.plan import RankShard
from llmserve.layers.module import Module


class VocabParallelEmbedding(Module):
    """Rows ``vocab[0]..vocab[1]`` of the table (padded to ``vocab_per_rank``), looked up by
    ``embed`` (an ``nn.Embedding``, or a ``QuantEmbedding`` whose blocks stay quantized)."""

    def __init__(self, embed: nn.Module, shard: RankShard):
        super().__init__()
        self.embed = embed
        self.start, self.end = shard.vocab

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        is_local = (input_ids >= self.start) & (input_ids < self.end)  # [T]
        local_ids = torch.where(is_local, input_ids - self.start, 0)
        x = self.embed(local_ids) * is_local.unsqueeze(-1)  # [T, hidden]
        dist.all_reduce(x)
        return x


class ParallelLMHead(Module):
    """Logits of this rank's vocabulary rows (``head``: a linear layer, float or quantized,
    ``[vocab_per_rank, hidden]``), gathered from every rank: ``[N, vocab]``."""

    def __init__(self, head: nn.Module, vocab_size: int, world_size: int):
        super().__init__()
        self.head = head
        self.vocab_size = vocab_size
        self.world_size = world_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.head(hidden).contiguous()  # [N, vocab_per_rank]
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]  # [N, vocab]


def _sum_over_ranks(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)
    return output


def apply_tensor_parallel(
    model: nn.Module, shard: RankShard, vocab_size: int, world_size: int
) -> nn.Module:
    """Make a model built from ``local_config`` compute its part and communicate the rest."""
    for layer in model.layers:  # row-parallel biases come on rank 0 only (weights.py)
        layer.self_attn.register_forward_hook(_sum_over_ranks)
        layer.mlp.register_forward_hook(_sum_over_ranks)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, shard)
    model.lm_head = ParallelLMHead(model.lm_head, vocab_size, world_size)  # tied: same rows
    return model

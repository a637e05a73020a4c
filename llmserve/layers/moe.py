"""Mixture of experts (Mixtral, Qwen3-MoE): a router picks ``top_k`` experts per token.

Tokens are grouped by expert and each expert runs once on its group (a loop over experts,
never over tokens):

    router logits [T, E] -> softmax -> top-k (weights [T, k], expert ids [T, k])
    (token, slot) pairs sorted by expert:  e0: t0 t3 | e1: t0 t1 t2 | e2: ... -> one GEMM each
    out[t] = sum over its k experts of weight * down(act(gate) * up)
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.mlp import get_activation


class SparseMoE(nn.Module):
    """``gate``: the router; ``w13 [E, 2 * I, hidden]`` gate then up rows; ``w2 [E, hidden, I]``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        normalize_top_k: bool,
        act: str = "silu",
    ):
        super().__init__()
        self.num_experts, self.top_k, self.normalize_top_k = num_experts, top_k, normalize_top_k
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()  # [T * k]
        order = flat.argsort(stable=True)
        tokens = order // self.top_k  # [T * k] token of each sorted (token, slot) pair
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.flatten()[order].to(x.dtype)[:, None]  # [T * k, 1]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            gate, up = (x[rows] @ self.w13[expert].T).chunk(2, dim=-1)  # [n, I] each
            y = (self.act(gate) * up) @ self.w2[expert].T  # [n, hidden]
            out.index_add_(0, rows, y * pair_weights[start : start + count])
            start += count
        return out

"""Mixture of experts (Mixtral, Qwen3-MoE): a router picks ``top_k`` experts per token.

Tokens are grouped by expert and each expert runs once on its group (a loop over experts,
never over tokens):

    router logits [T, E] -> softmax -> top-k (weights [T, k], expert ids [T, k])
    (token, slot) pairs sorted by expert:  e0: t0 t3 | e1: t0 t1 t2 | e2: ... -> one GEMM each
    out[t] = sum over its k experts of weight * down(act(gate) * up)

Float experts are two stacked parameters (one GEMM per expert reads a slice). A quantization
method first calls ``unstack_experts``: each expert becomes an ``nn.Linear`` in ``experts13`` /
``experts2`` (views of the stacked weights, no copy), which it then swaps for its own layer
like any other linear; the router stays float.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from llmserve.layers.mlp import get_activation
from llmserve.layers.module import Module


class SparseMoE(Module):
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
        self.experts13: nn.ModuleList | None = None  # per-expert layers, once unstacked
        self.experts2: nn.ModuleList | None = None
        self.act = get_activation(act)

    def unstack_experts(self) -> None:
        """Replace the stacked ``w13`` / ``w2`` by one ``nn.Linear`` per expert and projection."""
        if self.experts13 is not None:
            return
        self.experts13 = nn.ModuleList(_linear_view(w) for w in self.w13.detach())
        self.experts2 = nn.ModuleList(_linear_view(w) for w in self.w2.detach())
        del self.w13, self.w2

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
            h = x[rows]  # [n, hidden]
            if self.experts13 is None:  # stacked float weights
                gate, up = (h @ self.w13[expert].T).chunk(2, dim=-1)  # [n, I] each
                y = (self.act(gate) * up) @ self.w2[expert].T  # [n, hidden]
            else:  # one (quantized) layer per expert
                gate, up = self.experts13[expert](h).chunk(2, dim=-1)
                y = self.experts2[expert](self.act(gate) * up)
            out.index_add_(0, rows, y * pair_weights[start : start + count])
            start += count
        return out


def _linear_view(weight: torch.Tensor) -> nn.Linear:
    """A bias-free ``nn.Linear`` whose weight is ``weight`` itself (``[out, in]``)."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def expert_layer_name(module_name: str) -> str | None:
    """The mixture-of-experts layer (``layers.3.mlp``) of one expert's linear layer
    (``layers.3.mlp.experts13.5``); None for any other module."""
    found = re.fullmatch(r"(.+)\.experts(?:13|2)\.\d+", module_name)
    return None if found is None else found.group(1)

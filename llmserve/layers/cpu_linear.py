"""Fast fp32 and bf16 linear layers on CPU: oneDNN with weights packed once at load time.

``F.linear`` hands each call to a generic GEMM that re-lays out the weight on the fly; a
weight reordered once into oneDNN's blocked layout skips that and runs 1.3-2x faster here,
most of all at decode batch sizes and for the 49k-row LM head (see docs/benchmarks.md). bf16
weights are packed only where oneDNN runs bf16 natively (AVX512_BF16 or AMX; fp32
accumulation inside), 1.3-2x faster than ``F.linear`` on bf16 there.
Applied to a plain model after its weights are loaded, like a quantization pass.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pack_linear_layers`` helps a model of this dtype on this device."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return has_native_bf16()
    return dtype == torch.float32


def has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX512_BF16 or AMX, as oneDNN sees it)."""
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` prepacked for oneDNN (inference only)."""

    def __init__(self, linear: nn.Linear, batch_size_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linear_layers(model: nn.Module, batch_size_hint: int = 64) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``PackedLinear``; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        model.set_submodule(name, PackedLinear(linear, batch_size_hint))
    return len(targets)

"""RMSNorm (the residual add fused into the same call), Gemma's (1 + w) RMSNorm, and ``make_norm``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers.module import Module


class RMSNorm(Module):
    """``x / rms(x) * weight``; with ``residual`` it returns ``(norm(x + residual), x + residual)``.

    ``kernels``: torch, cpp (one pass, and in place with the residual: the caller's ``x`` and
    ``residual`` are overwritten) or triton.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, kernels: str = "torch"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernels == "triton":
            from llmserve.kernels import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if self.kernels == "cpp":  # float32 or bfloat16 (resolve_attention_backend)
            if residual is None:
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            return cpu_kernels.fused_add_rms_norm_(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        normed = self._norm(x)
        return normed if residual is None else (normed, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)  # [num_tokens, 1]
        return (x32 * torch.rsqrt(variance + self.eps)).to(dtype) * self.weight


class GemmaRMSNorm(Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` computed in float32 (weights stored as offsets)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(kind: str, hidden_size: int, eps: float, bias: bool = True) -> nn.Module:
    """``kind``: "layer" (LayerNorm, ``bias`` optional), "rms" or "gemma_rms"; torch ops only."""
    if kind == "layer":
        return nn.LayerNorm(hidden_size, eps=eps, bias=bias)
    if kind == "rms":
        return RMSNorm(hidden_size, eps)
    if kind == "gemma_rms":
        return GemmaRMSNorm(hidden_size, eps)
    raise ValueError(f"norm kind {kind!r} is not one of layer, rms, gemma_rms")

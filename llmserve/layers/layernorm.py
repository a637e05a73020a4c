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
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` computed in float32 (weights stored as
    offsets). ``kernels="cpp"``: one C++ pass (``rms_norm`` with ``1 + weight`` in float32,
    computed once the weights are loaded)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, kernels: str = "torch"):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.kernels = kernels
        self._scale: tuple[tuple[int, int], torch.Tensor] | None = None  # (weight's key, 1 + w)

    def _one_plus_weight(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)  # a weight loaded in place moves it
        if self._scale is None or self._scale[0] != key:
            self._scale = key, 1.0 + self.weight.detach().float()
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "cpp":  # float32 or bfloat16 (resolve_attention_backend)
            return cpu_kernels.rms_norm(x, self._one_plus_weight(), self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def kernels_for(backend: str) -> str:
    """The element-wise kernels (norms, gated activations) that go with an attention backend:
    the C++ ones with ``cpp`` (float32 or bfloat16 on the CPU), torch's otherwise."""
    return "cpp" if backend == "cpp" else "torch"


def make_norm(
    kind: str, hidden_size: int, eps: float, bias: bool = True, kernels: str = "torch"
) -> nn.Module:
    """``kind``: "layer" (LayerNorm, ``bias`` optional), "rms" or "gemma_rms"; ``kernels``
    ("torch" or "cpp") for the RMS norms."""
    if kind == "layer":
        return nn.LayerNorm(hidden_size, eps=eps, bias=bias)
    if kind == "rms":
        return RMSNorm(hidden_size, eps, kernels)
    if kind == "gemma_rms":
        return GemmaRMSNorm(hidden_size, eps, kernels)
    raise ValueError(f"norm kind {kind!r} is not one of layer, rms, gemma_rms")

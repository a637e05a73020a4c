"""SwiGLU activation: ``silu(gate) * up`` on the fused gate_up projection."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers.module import Module


class SiluAndMul(Module):
    """``x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]``; ``kernels``: torch, cpp or triton."""

    def __init__(self, kernels: str = "torch"):
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "triton":
            from llmserve.kernels import silu_and_mul

            return silu_and_mul(x)
        if self.kernels == "cpp":  # float32 or bfloat16 (resolve_attention_backend)
            return cpu_kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

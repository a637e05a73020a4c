"""SwiGLU activation: ``silu(gate) * up`` on the fused gate_up projection."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SiluAndMul(nn.Module):
    """``x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]``."""

    def __init__(self, use_triton: bool = False):
        super().__init__()
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from llmserve.kernels import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

"""Feed-forward blocks: gated (SwiGLU, GeGLU: ``down(act(gate) * up)``) or plain (``down(act(up))``).

Activation names are Hugging Face's (``hidden_act``); every one maps to a torch function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers.module import Module


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# gated activations the C++ kernels fuse with the product (one pass over gate|up rows)
CPP_GATED = {
    F.silu: cpu_kernels.silu_and_mul,
    _gelu_tanh: cpu_kernels.gelu_tanh_and_mul,
}


class MLP(Module):
    """``gated``: ``gate_up_proj`` holds gate then up rows; else ``up_proj``. Then ``down_proj``.
    ``kernels="cpp"``: a gated SiLU or tanh-GELU in one C++ pass (``CPP_GATED``)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        gated: bool,
        bias: bool = False,
        kernels: str = "torch",
    ):
        super().__init__()
        self.gated = gated
        self.intermediate_size = intermediate_size
        width = 2 * intermediate_size if gated else intermediate_size
        if gated:
            self.gate_up_proj = nn.Linear(hidden_size, width, bias=bias)
        else:
            self.up_proj = nn.Linear(hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(act)
        self.fused = CPP_GATED.get(self.act) if gated and kernels == "cpp" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:  # float32 or bfloat16 (resolve_attention_backend)
            return self.down_proj(self.fused(self.gate_up_proj(x)))
        if self.gated:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate] each
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.up_proj(x)))

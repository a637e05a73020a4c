"""Position schemes besides the Llama path's fused RoPE (``rotary.py``):

* ``Rope``: rotary on the first ``rotary_dim`` channels of each head (partial rotary: NeoX,
  Phi, GPT-J), pairs as split halves ("neox") or adjacent channels ("gptj"), any base; the
  split halves by a C++ kernel on the cpp backend.
* ``alibi_slopes``: ALiBi's per-head slopes (BLOOM's and MPT's orderings differ when the head
  count is not a power of two); the bias itself is added in ``paged_attention_eager``.
* ``sinusoidal_positions``: fixed absolute embeddings (XGLM / fairseq).
Learned absolute positions are a plain ``nn.Embedding`` in the decoder.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers.module import Module
from llmserve.layers.rotary import compute_inv_freq


class Rope(Module):
    """q/k ``[num_tokens, heads * head_dim]`` -> rotated at ``positions``, same shape."""

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        params: dict[str, Any],
        max_position: int,
        max_model_len: int,
        is_neox: bool = True,
        kernels: str = "torch",
    ):
        super().__init__()
        self.kernels = kernels  # "cpp": NeoX pairs by the C++ kernel (rotary_neox)
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(
                f"rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}"
            )
        self.head_dim, self.rotary_dim, self.is_neox = head_dim, rotary_dim, is_neox
        inv_freq, scaling = compute_inv_freq(params, rotary_dim, max_position, max_model_len)
        t = torch.arange(max_model_len, dtype=torch.float64)  # positions stay below it
        freqs = torch.outer(t, inv_freq)  # [max_positions, rotary_dim // 2]
        self.register_buffer("cos", (freqs.cos() * scaling).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling).float(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels == "cpp" and self.is_neox:  # float32 or bfloat16 (the cpp backend)
            args = (positions, self.cos, self.sin, self.head_dim, self.rotary_dim)
            return cpu_kernels.rotary_neox(q, *args), cpu_kernels.rotary_neox(k, *args)
        cos = self.cos[positions].float()[:, None, :]  # [T, 1, rotary_dim // 2]
        sin = self.sin[positions].float()[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_dim)  # [T, heads, D]
        rot, rest = x[..., : self.rotary_dim].float(), x[..., self.rotary_dim :]
        if self.is_neox:
            x1, x2 = rot.chunk(2, dim=-1)  # [T, heads, rotary_dim // 2] each
            rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([rot.to(x.dtype), rest], dim=-1).reshape(shape)


def alibi_slopes(num_heads: int, max_bias: float = 8.0, order: str = "bloom") -> torch.Tensor:
    """ALiBi slopes ``[num_heads]``: ``2^(-max_bias * i / n)`` for a power of two ``n``.

    Otherwise ``order="bloom"`` takes the closest lower power of two and fills in every other
    slope of the next one; ``order="mpt"`` takes the next power of two's slopes, odd ones first.
    """
    if order == "mpt":
        n = 2 ** math.ceil(math.log2(num_heads))
        slopes = 2.0 ** (-max_bias * torch.arange(1, n + 1, dtype=torch.float64) / n)
        if n != num_heads:
            slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
        return slopes.float()
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-max_bias / closest)
    slopes = [base**i for i in range(1, closest + 1)]
    if closest != num_heads:
        extra_base = 2.0 ** (-max_bias / (2 * closest))
        num_extra = min(closest, num_heads - closest)
        slopes += [extra_base**i for i in range(1, 2 * num_extra + 1, 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def sinusoidal_positions(num_positions: int, dim: int, offset: int = 0) -> torch.Tensor:
    """fairseq's table ``[num_positions, dim]``: sin half then cos half, row ``p`` holding
    position ``p + offset``."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -step)  # [dim // 2]
    angles = torch.arange(offset, offset + num_positions, dtype=torch.float32)[:, None] * freqs
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    return table

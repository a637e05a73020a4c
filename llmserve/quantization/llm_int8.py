"""LLM.int8() (Dettmers et al. 2022), bitsandbytes' 8-bit inference: int8 weights and
activations, with the few outlier input features computed in floating point.

Weight, once (bitsandbytes' ``Int8Params``): per output row ``n``

    SCB[n] = max_k |W[n, k]|          CB[n, k] = round(W[n, k] * 127 / SCB[n])   (int8)

Forward, per call, for ``x [T, K]``:

    outlier entries   |x[t, k]| >= threshold           (threshold 0: none)
    outlier columns   O = the k with any outlier entry
    SCA[t]   = max_k |x[t, k]| over non-outlier entries
    CA[t, k] = round(x[t, k] * 127 / SCA[t]), 0 on outlier entries and columns O   (int8)

    y = (CA @ CB^T) * SCA[t] * SCB[n] / 127^2            int8 x int8 -> int32, then scaled
      + x[:, O] @ (CB[:, O] * SCB / 127)^T                the outlier columns, in floating point
      + bias

On the CPU the int8 product and its scaling run in one call of llmserve's integer GEMM
(``kernels/cpu/quant_gemm.cpp``: AVX-512 VNNI or AVX2, int32 dots per block of 32 columns,
scaled in fp32): about 10x faster than ``torch._int_mm`` on an AVX2 CPU (docs/bench/journal.md);
elsewhere, or without the kernels, ``torch._int_mm``.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.kernels.cpu import quant
from llmserve.layers.module import Module
from llmserve.quantization.layout import BLOCK, QuantizedWeight


def quantize_rows(matrix: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """float ``[R, C]`` -> int8 ``round(x * 127 / absmax[r])`` (an all-zero row gives 0)."""
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))  # [R]
    return torch.round(matrix * (127.0 / safe).unsqueeze(1)).to(torch.int8)


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 ``a [M, K]`` times int8 ``b [N, K]`` transposed -> int32 ``[M, N]``, exactly."""
    try:
        return torch._int_mm(a, b.t())
    except RuntimeError:  # shapes or devices _int_mm refuses (CUDA needs M > 16, K % 8 == 0)
        return (a.double() @ b.double().t()).to(torch.int32)


def scaled_int8_matmul(
    ca: torch.Tensor, sca: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor
) -> torch.Tensor:
    """``(ca @ cb^T) * sca[t] * scb[n] / 127^2`` in fp32: int8 ``ca [T, K]``, ``cb [N, K]``."""
    in_features = ca.shape[1]
    if ca.device.type == "cpu" and in_features % BLOCK == 0 and quant.available():
        # one weight group of K columns (scale scb / 127); the activation scale per block
        weight = QuantizedWeight(8, cb, (scb / 127.0).unsqueeze(1), None, in_features)
        xs = (sca / 127.0).unsqueeze(1).expand(-1, in_features // BLOCK).contiguous()
        return quant.quant_gemm(ca.contiguous(), xs, weight)
    acc = int8_matmul(ca, cb)  # int32 [T, N]
    return acc.float() * (sca.unsqueeze(1) * scb.unsqueeze(0)) * (1.0 / 127**2)


class LLMInt8Linear(Module):
    """``y = x @ W^T + b`` by LLM.int8(); state in buffers ``CB``, ``SCB``, ``bias``."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, threshold: float = 6.0
    ):
        super().__init__()
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"expected a float weight [out, in], got {weight.dtype} {tuple(weight.shape)}"
            )
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0 (0 disables outliers), got {threshold}")
        w = weight.detach().float()
        scb = w.abs().amax(dim=1)  # [N]
        self.register_buffer("CB", quantize_rows(w, scb))  # int8 [N, K]
        self.register_buffer("SCB", scb)  # float32 [N]
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = w.shape
        self.threshold = float(threshold)

    @classmethod
    def from_linear(cls, linear: nn.Linear, threshold: float = 6.0) -> LLMInt8Linear:
        return cls(linear.weight, linear.bias, threshold=threshold)

    @property
    def weight_nbytes(self) -> int:
        """Resident bytes of the quantized weight (``CB`` and ``SCB``; the bias not counted)."""
        return self.CB.numel() * self.CB.element_size() + self.SCB.numel() * self.SCB.element_size()

    @property
    def graph_capturable(self) -> bool:
        """Whether a CUDA graph can record forward: not with outliers, whose columns
        (``nonzero``) and count change with every input."""
        return self.threshold == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # [T, K]
        out = self._matmul(x2)  # [T, N]
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*leading, self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_zeros(0, self.out_features)
        outliers = self._outliers(x)  # bool [T, K] or None
        inliers = x if outliers is None else x.masked_fill(outliers, 0.0)  # [T, K]
        sca = inliers.abs().amax(dim=1)  # [T]
        ca = quantize_rows(inliers, sca)  # int8 [T, K]
        cols = None
        if outliers is not None:
            cols = outliers.any(dim=0).nonzero().flatten()  # [num_outlier_cols]
            ca[:, cols] = 0
        out = scaled_int8_matmul(ca, sca, self.CB, self.SCB)  # [T, N]
        if cols is not None and cols.numel():
            w_cols = self.CB[:, cols].float() * (self.SCB / 127.0).unsqueeze(1)  # [N, num_cols]
            out = out.addmm(x[:, cols], w_cols.t())
        return out

    def _outliers(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.threshold == 0:
            return None
        return x.abs() >= self.threshold  # [T, K], as bitsandbytes (>=)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, threshold={self.threshold}"

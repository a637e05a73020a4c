"""Group quantization by round-to-nearest: the grid every method ends on, and the baseline.

One linear weight ``W [N = out_features, K = in_features]`` becomes integer codes, and per
output row and group of ``G`` input columns a scale and a zero point:

    W[n, k] ~ scale[n, g] * (code[n, k] - zero[n, g])        g = g_idx[k], code in 0..2^bits-1

Two ways to pick (scale, zero) from a group's values, as the tools that define the formats do:

    gptq style (AutoGPTQ's Quantizer)   range [min(w, 0), max(w, 0)]; sym: zero = 2^(bits-1)
                                        and range +-max|w|; asym: zero = round(-min / scale)
                                        at least 1 (GPTQ v1 stores zero - 1, which cannot be -1)
    awq style (AutoAWQ's pseudo-quant)  range [min(w), max(w)], zero = -round(min / scale)
                                        clamped to 0..2^bits-1

Scales are rounded to fp16 (the stored dtype) before any code is computed, so the codes are
exact for the scales written to the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Style = Literal["gptq", "awq"]


@dataclass
class QuantResult:
    """One quantized linear weight, in its original column order."""

    codes: torch.Tensor
    """uint8 ``[N, K]``, 0..2^bits-1."""
    zeros: torch.Tensor
    """int64 ``[N, num_groups]``."""
    scales: torch.Tensor
    """float32 ``[N, num_groups]``, fp16-exact."""
    g_idx: torch.Tensor
    """int64 ``[K]``: group of each input column (act-order: not k // G)."""
    bits: int

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: the weight the checkpoint represents."""
        g = self.g_idx
        scales = self.scales.index_select(1, g)  # [N, K]
        return scales * (self.codes.float() - self.zeros.index_select(1, g).float())


def group_params(
    w: torch.Tensor, bits: int, sym: bool, style: Style = "gptq", mse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, C]`` (one group's columns) -> (scale, zero) float32 ``[N]`` each; with ``mse``
    the range is shrunk, per row, to the factor in 1.00, 0.99 .. 0.81 with the least
    sum |w - dequantized|^2.4 (the GPTQ reference's search)."""
    if mse:
        return _mse_group_params(w, bits, sym)
    maxq = 2**bits - 1
    if style == "awq":
        xmin, xmax = w.amin(dim=1), w.amax(dim=1)
        scale = _fp16((xmax - xmin).clamp(min=1e-5) / maxq)
        return scale, (-torch.round(xmin / scale)).clamp(0, maxq)
    xmin, xmax = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)
    xmin, xmax = xmin.masked_fill(empty, -1.0), xmax.masked_fill(empty, 1.0)
    scale = _fp16((xmax - xmin) / maxq)
    if sym:
        return scale, torch.full_like(scale, 2 ** (bits - 1))
    return scale, torch.round(-xmin / scale).clamp(1, maxq)


MSE_SHRINKS = [1.0 - i / 100 for i in range(20)]
MSE_NORM = 2.4


def _mse_group_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    best_scale, best_zero = group_params(w, bits, sym)
    best_err = _group_error(w, best_scale, best_zero, bits)
    for shrink in MSE_SHRINKS[1:]:
        scale, zero = group_params(w * shrink, bits, sym)
        err = _group_error(w, scale, zero, bits)
        better = err < best_err
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_err = torch.minimum(err, best_err)
    return best_scale, best_zero


def _group_error(w, scale, zero, bits) -> torch.Tensor:
    q = quantize_values(w, scale, zero, bits)
    return (scale[:, None] * (q - zero[:, None]) - w).abs().pow(MSE_NORM).sum(dim=1)


def quantize_values(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:
    """Codes (float, 0..2^bits-1) of ``w [N, C]`` (or ``[N]``) for per-row ``scale, zero``."""
    if w.dim() == 2:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def quantize_rtn(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    style: Style = "gptq",
    mse: bool = False,
) -> QuantResult:
    """Round every weight to the nearest level of its group's grid (no calibration)."""
    w = weight.float()  # [N, K]
    n, k = w.shape
    g = k if group_size == -1 else group_size
    grouped = w.reshape(n * (k // g), g)  # [N * num_groups, G]
    scale, zero = group_params(grouped, bits, sym, style, mse)
    codes = quantize_values(grouped, scale, zero, bits)
    return QuantResult(
        codes=codes.reshape(n, k).to(torch.uint8),
        zeros=zero.reshape(n, k // g).long(),
        scales=scale.reshape(n, k // g),
        g_idx=torch.arange(k) // g,
        bits=bits,
    )


def _fp16(scale: torch.Tensor) -> torch.Tensor:
    """Round to fp16 (the stored dtype), kept at or above 2^-20 so that no scale becomes 0."""
    return scale.clamp(min=2**-20).half().float()

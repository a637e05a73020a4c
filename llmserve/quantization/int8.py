"""Run-time int8 weight-only quantization (W8A16): one symmetric scale per output row.

    scale[n]  = max_k |W[n, k]| / 127
    value[n, k] = clamp(round(W[n, k] / scale[n]), -127, 127)       W ~ scale[n] * value[n, k]

The result is a ``QuantizedWeight`` with ``bits=8`` and ``group_size = K`` (no mins), run by
the shared W8A16 kernels; activations stay in floating point.
"""

from __future__ import annotations

import torch

from llmserve.quantization.layout import BLOCK, QuantizedWeight


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Float ``[N, K]`` -> int8 values with a per-output-channel absmax scale (group = K)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"expected a float weight [out, in], got {weight.dtype} {tuple(weight.shape)}"
        )
    in_features = weight.shape[1]
    if in_features % BLOCK:
        raise ValueError(f"int8 needs in_features divisible by {BLOCK}, got {in_features}")
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1, keepdim=True)  # [N, 1]
    scales = absmax / 127.0  # [N, 1]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row stays 0
    values = torch.round(w / safe).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return QuantizedWeight(bits=8, qweight=values, scales=scales, mins=None, group_size=in_features)

"""K and V rows into and out of a KV pool narrower than the model's dtype (--kv-cache-dtype;
runner/kv_cache.py has the picture), for the torch attention paths: the C++ kernels do the
same in their own loops (kernels/cpu/fp8.h)."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """New K or V rows in the pool's ``dtype``: ``x / scale``, rounded (fp8: saturated). The
    scales apply to a pool narrower than the model's only (x in the pool's dtype: as it is)."""
    if x.dtype == dtype:
        return x
    # times 1 / scale in fp32, as the C++ write does, so both backends store the same bits
    # (out of place: x may be the step's own K/V rows, which the attention reads after)
    x = x.float() * (1.0 / scale) if scale != 1.0 else x
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Rows read from a pool, in the model's ``dtype`` (times the pool's scale)."""
    if x.dtype == dtype:
        return x
    if scale == 1.0:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as a pool of ``dtype`` gives it back: what a prompt's own rows read when they
    attend over the step's K/V directly (SDPA) instead of through the pool."""
    if x.dtype == dtype:
        return x
    return dequantize(quantize(x, dtype, scale), x.dtype, scale)

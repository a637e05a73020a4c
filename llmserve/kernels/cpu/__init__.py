"""Native CPU kernels (C++), compiled on first use with torch's extension builder.

    paged_attention.cpp   paged_decode_attention: decode attention reading K/V in place
                          from the paged pool
    fused.cpp             rms_norm, fused_add_rms_norm_, silu_and_mul, rotary_interleaved:
                          one pass over memory each

All are fp32, vectorized with AVX2/FMA when the compiler targets them (-march=native), and
threaded with torch's intra-op pool.

The build (``build.py``) takes about half a minute once per machine and is cached by torch
(under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), keyed by this CPU's
flags since it uses ``-march=native``. Without a C++ compiler, or with
``LLMSERVE_CPU_KERNELS=0``, ``available()`` is False and callers keep their plain-torch path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmserve.kernels.cpu.build import NativeLibrary, cpu_flags_hash

_HERE = Path(__file__).parent
LIBRARY = NativeLibrary(
    name="llmserve_cpu_kernels",
    namespace="llmserve_cpu",
    sources=[_HERE / "paged_attention.cpp", _HERE / "fused.cpp"],
    headers=[_HERE / "vec.h"],
    cflags=["-march=native", f"-DLLMSERVE_CPU={cpu_flags_hash()}"],
    probe_ops=("silu_and_mul",),
)


def available() -> bool:
    """Whether the native kernels are built and loaded (builds them on the first call)."""
    return LIBRARY.available()


def _ops():
    """The registered ops, building them first if needed."""
    return LIBRARY.ops()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q ``[n, H, D]`` fp32, caches ``[blocks, block_size, kvh, D]``, ``block_tables [n, >=
    ceil(len / block_size)]`` int32, ``seq_lens [n]`` int32 -> ``[n, H, D]``."""
    if out is None:
        out = torch.empty_like(q)
    _ops().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    return _ops().rms_norm(x, weight, eps)


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``; returns ``(x, residual)``."""
    _ops().fused_add_rms_norm_(x, residual, weight, eps)
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2d] -> silu(x[..., :d]) * x[..., d:]``."""
    return _ops().silu_and_mul(x)


def rotary_interleaved(
    x: torch.Tensor, positions: torch.Tensor, cis: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """``x: [T, heads * D]`` (rows may be strided), pairs ``(x[2i], x[2i+1])`` of each head
    rotated by ``cis[position]`` (``[max_pos, D/2, 2]`` cos/sin) -> a new contiguous tensor."""
    return _ops().rotary_interleaved(x, positions, cis, head_dim)

"""Native CPU kernels (C++), compiled on first use with torch's extension builder.

    paged_attention.cpp   paged_decode_attention: decode attention reading K/V in place
                          from the paged pool
    fused.cpp             rms_norm, fused_add_rms_norm_, silu_and_mul, rotary_interleaved:
                          one pass over memory each

All are fp32, vectorized with AVX2/FMA when the compiler targets them (-march=native), and
threaded with torch's intra-op pool.

The build takes about half a minute once per machine and is cached by torch (under
``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). Without a C++ compiler, or
with ``LLMSERVE_CPU_KERNELS=0``, ``available()`` is False and callers keep their plain-torch
path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "fused.cpp")]
_HEADERS = [Path(__file__).with_name("vec.h")]
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _headers_hash() -> str:
    """torch rebuilds when a source or a flag changes; the headers' hash, passed as a flag,
    makes a header change count too."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS)).hexdigest()
    return digest[:16]


def _cpu_flags_hash() -> str:
    """A digest of this CPU's instruction-set flags. ``-march=native`` code built on one host
    must never be reused from the cache on another (an AVX-512 build dies with SIGILL on an
    AVX2-only host), so the flags are part of the build's flags and a new CPU rebuilds."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:16]


def _build() -> bool:
    from torch.utils.cpp_extension import load

    # torch runs `ninja` from PATH; the pip-installed one sits beside this interpreter
    bin_dir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

    logger.info("building the C++ CPU kernels (once per machine; cached by torch)")
    load(
        name="llmserve_cpu_kernels",
        sources=[str(p) for p in _SOURCES],
        # -fopenmp: at::parallel_for is an OpenMP region compiled into this library; the
        # process already has torch's libgomp loaded, which the library then shares.
        extra_cflags=[
            "-O3",
            "-march=native",
            "-fopenmp",
            f"-DLLMSERVE_HEADERS={_headers_hash()}",
            f"-DLLMSERVE_CPU={_cpu_flags_hash()}",
        ],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return hasattr(torch.ops.llmserve_cpu, "silu_and_mul")


def available() -> bool:
    """Whether the native kernels are built and loaded (builds them on the first call)."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                ok = False
                if os.environ.get("LLMSERVE_CPU_KERNELS", "1") != "0":
                    try:
                        ok = _build()
                    except Exception as exc:  # no compiler, failed build: keep the torch path
                        logger.warning("C++ CPU kernels unavailable, using plain torch: %s", exc)
                _state["ok"] = ok
    return _state["ok"]


def _ops():
    """The registered ops, building them first if needed."""
    if not available():
        raise RuntimeError("the C++ CPU kernels are not built (the log says why)")
    return torch.ops.llmserve_cpu


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

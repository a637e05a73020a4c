"""Kernels: Triton implementations, each tested against a plain-torch reference in reference.py.

    flash_attention.py  flash_attn_varlen_paged   packed causal prefill over the paged pool
    paged_decode.py     paged_decode_attention    split-K decode, one query per sequence
    fused.py            rms_norm, silu_and_mul, rotary_embedding_, reshape_and_cache
    reference.py        ref_* in plain torch (slow, for tests)

Names are imported on first use, so ``import llmserve.kernels`` works without Triton and
Triton's ``TRITON_INTERPRET`` switch is read only when a kernel module is first loaded.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "flash_attn_varlen_paged": "flash_attention",
    "paged_decode_attention": "paged_decode",
    "rms_norm": "fused",
    "silu_and_mul": "fused",
    "rotary_embedding_": "fused",
    "reshape_and_cache": "fused",
    "ref_paged_attention": "reference",
    "ref_rms_norm": "reference",
    "ref_silu_and_mul": "reference",
    "ref_rotary": "reference",
    "ref_reshape_and_cache": "reference",
}

__all__ = [
    "is_triton_available",
    "flash_attn_varlen_paged",
    "paged_decode_attention",
    "rms_norm",
    "silu_and_mul",
    "rotary_embedding_",
    "reshape_and_cache",
    "ref_paged_attention",
    "ref_rms_norm",
    "ref_silu_and_mul",
    "ref_rotary",
    "ref_reshape_and_cache",
]

if TYPE_CHECKING:
    from .flash_attention import flash_attn_varlen_paged
    from .fused import reshape_and_cache, rms_norm, rotary_embedding_, silu_and_mul
    from .paged_decode import paged_decode_attention
    from .reference import (
        ref_paged_attention,
        ref_reshape_and_cache,
        ref_rms_norm,
        ref_rotary,
        ref_silu_and_mul,
    )


def is_triton_available() -> bool:
    """True when Triton imports and can run: on a CUDA GPU, or on CPU with TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes"):
        return True
    import torch

    return torch.cuda.is_available()


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
    return getattr(module, name)

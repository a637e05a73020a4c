"""Attention over the paged KV cache, with a choice of backend (torch, cpp or Triton).

ALiBi and logit soft-capping take the eager path (``paged_attention_eager``) in every
backend. A sliding window that a context outgrows is the C++ kernels' own (the cpp backend:
each row reads its window's blocks only); the torch and Triton backends take the eager path
for it. A window the context still fits in changes nothing, so those steps keep the
backend's own kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers import kv_quant
from llmserve.layers.attention_metadata import AttentionMetadata
from llmserve.layers.module import Module
from llmserve.layers.paged_attention_eager import ScoreOptions, paged_attention_eager
from llmserve.layers.paged_attention_torch import TorchAttentionPlan, paged_attention_torch

KVCache = tuple[
    torch.Tensor, torch.Tensor
]  # k, v: [num_blocks, block_size, num_kv_heads, head_dim]


class Attention(Module):
    """Writes this step's K/V into the pool, then attends over each sequence's context."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: str,
        sliding_window: int | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window or None
        self.softcap = softcap or None
        # [num_heads] float32; a plain attribute, so ``model.to(dtype)`` leaves it float32
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.float()
        # a quantized KV pool (--kv-cache-dtype fp8) holds K / k_scale and V / v_scale
        self.k_scale = self.v_scale = 1.0

    def window(self, meta: AttentionMetadata) -> int:
        """The sliding window this step must apply: 0 when it has none or every context of
        the step still fits in it."""
        window = self.sliding_window
        return window if window is not None and meta.max_seq_len > window else 0

    def needs_eager(self, meta: AttentionMetadata, native: bool = False) -> bool:
        """Whether this step needs scores the backend's kernels cannot produce (``native``:
        the C++ kernels, which take a sliding window)."""
        window = not native and self.window(meta) > 0
        return window or self.softcap is not None or self.alibi_slopes is not None

    def _eager(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.backend == "triton":
            from llmserve import kernels

            kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        slopes = self.alibi_slopes
        if slopes is not None and slopes.device != q.device:
            slopes = self.alibi_slopes = slopes.to(q.device)
        opts = ScoreOptions(
            self.scale, self.sliding_window, self.softcap, slopes, self.k_scale, self.v_scale
        )
        return paged_attention_eager(q, k_cache, v_cache, meta, opts)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q ``[T, H * D]``, k/v ``[T, kvh * D]`` -> ``[T, H * D]``."""
        plan = meta.plan
        if (
            isinstance(plan, TorchAttentionPlan)
            and plan.native_decode
            and not self.needs_eager(meta, native=True)
        ):  # C++ kernels: the K/V write and the attention in one call
            window = self.window(meta)
            if meta.num_decodes == q.shape[0]:  # decodes only (split-K for a small batch)
                return cpu_kernels.decode_attention(
                    q, k, v, *kv_cache, meta.slot_mapping, plan.decode_tables,
                    plan.decode_seq_lens, self.scale, window, self.k_scale, self.v_scale,
                )  # fmt: skip
            return cpu_kernels.paged_attention(  # prompt chunks (and decodes) of any length
                q, k, v, *kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, self.scale, None, window, self.k_scale, self.v_scale,
            )  # fmt: skip
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if self.needs_eager(meta):
            out = self._eager(q, k, v, k_cache, v_cache, meta)
        elif self.backend == "triton":
            out = self._triton(q, k, v, k_cache, v_cache, meta)
        else:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            assert isinstance(meta.plan, TorchAttentionPlan)
            out = paged_attention_torch(
                q, k, v, k_cache, v_cache, meta, meta.plan, self.scale, self.k_scale, self.v_scale
            )
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _triton(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        from llmserve import kernels

        kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = kernels.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.seq_lens[:nd], meta.block_tables[:nd], self.scale
            )
        if meta.num_seqs > nd:
            start = meta.query_start_loc[nd:] - nd  # [num_prefills + 1]
            out[nd:] = kernels.flash_attn_varlen_paged(
                q[nd:],
                k_cache,
                v_cache,
                start,
                meta.seq_lens[nd:],
                meta.block_tables[nd:],
                self.scale,
                meta.max_query_len,
            )
        return out


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store new keys and values at their slots: ``cache.view(-1, kvh, D)[slot] = k`` (a
    transposed K pool, kv_cache.allocate, is written through its (block, offset) indices), in
    the pool's dtype (``kv_quant.quantize``: divided by the scale where it is narrower)."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = kv_quant.quantize(k, k_cache.dtype, k_scale)
    v = kv_quant.quantize(v, v_cache.dtype, v_scale)
    if k_cache.dtype in kv_quant.FP8_DTYPES:  # index_copy_ has no fp8 kernel: copy the bytes
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    if k_cache.is_contiguous():
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    else:
        block_size = k_cache.shape[1]
        k_cache[slot_mapping // block_size, slot_mapping % block_size] = k
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def has_eager_attention(model: nn.Module, max_model_len: int) -> bool:
    """Whether some layer can take the eager path (its per-sequence loop reads host-side
    lengths, so a CUDA graph cannot capture it); a window no context outgrows never does."""
    return any(
        isinstance(m, Attention)
        and (
            (m.sliding_window is not None and m.sliding_window < max_model_len)
            or m.softcap is not None
            or m.alibi_slopes is not None
        )
        for m in model.modules()
    )

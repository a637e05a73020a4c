"""Paged attention in plain torch: vectorized over sequences, for CPU (and as a fallback).

Both paths gather each sequence's K/V from the pool through its block table and run one
``scaled_dot_product_attention`` over the padded batch. Grouped-query attention needs no
copy of K/V per query head: the ``G = num_heads // num_kv_heads`` query heads of a group are
folded into the query-length axis,

    q: [B, kv_heads, G * q_len, D]   k, v: [B, kv_heads, ctx, D]   mask: [B, 1, G * q_len, ctx]

so a decode step is one batched matmul per layer, with no Python loop over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from llmserve.runner.attention_metadata import AttentionMetadata


@dataclass
class TorchAttentionPlan:
    """Index tensors built once per step and shared by every layer."""

    decode_tables: torch.Tensor  # [num_decodes, num_blocks_d] block ids
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, ctx_d] bool, True = attend
    prefill_tables: torch.Tensor  # [num_prefills, num_blocks_p]
    prefill_mask: torch.Tensor  # [num_prefills, 1, max_q, ctx_p] bool
    prefill_q_index: torch.Tensor  # [num_prefills, max_q] token index of each padded query
    prefill_valid: torch.Tensor  # [num_prefills * max_q] bool, real (not padding) queries


def build_plan(meta: AttentionMetadata, block_size: int) -> TorchAttentionPlan:
    device = meta.block_tables.device
    nd = meta.num_decodes
    d_ctx = max(meta.seq_lens_cpu[:nd], default=0)
    d_blocks = -(-d_ctx // block_size)
    positions = torch.arange(d_blocks * block_size, device=device)
    decode_mask = positions[None, :] < meta.seq_lens[:nd, None]  # [nd, ctx_d]
    q_lens = meta.query_lens_cpu[nd:]
    p_ctx = max(meta.seq_lens_cpu[nd:], default=0)
    max_q = max(q_lens, default=0)
    p_blocks = -(-p_ctx // block_size)
    q_lens_t = torch.tensor(q_lens, device=device)  # [np]
    seq_lens_p = meta.seq_lens[nd:]  # [np]
    rows = torch.arange(max_q, device=device)  # [max_q]
    q_pos = seq_lens_p[:, None] - q_lens_t[:, None] + rows[None, :]  # [np, max_q]
    k_pos = torch.arange(p_blocks * block_size, device=device)  # [ctx_p]
    valid = rows[None, :] < q_lens_t[:, None]  # [np, max_q]
    prefill_mask = (k_pos[None, None, :] <= q_pos[:, :, None]) | ~valid[:, :, None]
    q_index = (meta.query_start_loc[nd:-1, None] + rows[None, :]).clamp(
        max=max(meta.query_start_loc[-1].item() - 1, 0)
    )
    return TorchAttentionPlan(
        decode_tables=meta.block_tables[:nd, :d_blocks],
        decode_mask=decode_mask[:, None, None, :],
        prefill_tables=meta.block_tables[nd:, :p_blocks],
        prefill_mask=prefill_mask[:, None, :, :],
        prefill_q_index=q_index,
        prefill_valid=valid.reshape(-1),
    )


def _gather_kv(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``cache: [num_blocks, bs, kvh, D]``, ``tables: [B, nb]`` -> ``[B, kvh, nb * bs, D]``."""
    batch, num_blocks = tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, tables.reshape(-1))  # [B * nb, bs, kvh, D]
    return gathered.view(batch, num_blocks * block_size, kv_heads, head_dim).transpose(1, 2)


def _grouped_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q ``[B, q_len, H, D]``, k/v ``[B, kvh, ctx, D]``, mask ``[B, 1, q_len, ctx]`` -> ``[B, q_len, H, D]``."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    q = q.view(batch, q_len, kv_heads, group, head_dim).permute(
        0, 2, 3, 1, 4
    )  # [B, kvh, G, q_len, D]
    q = q.reshape(batch, kv_heads, group * q_len, head_dim)
    mask = mask.unsqueeze(2).expand(batch, 1, group, q_len, mask.shape[-1])
    mask = mask.reshape(batch, 1, group * q_len, mask.shape[-1])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, kvh, G*q, D]
    out = out.view(batch, kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, num_heads, head_dim)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: TorchAttentionPlan,
    scale: float,
) -> torch.Tensor:
    """q ``[num_tokens, H, D]`` (K/V already in the pool) -> ``[num_tokens, H, D]``."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        k = _gather_kv(k_cache, plan.decode_tables)
        v = _gather_kv(v_cache, plan.decode_tables)
        out[:nd] = _grouped_sdpa(q[:nd, None], k, v, plan.decode_mask, scale)[:, 0]
    if meta.num_seqs > nd:
        k = _gather_kv(k_cache, plan.prefill_tables)
        v = _gather_kv(v_cache, plan.prefill_tables)
        q_pad = q[plan.prefill_q_index]  # [np, max_q, H, D]
        o = _grouped_sdpa(q_pad, k, v, plan.prefill_mask, scale)  # [np, max_q, H, D]
        out[nd:] = o.reshape(-1, *q.shape[1:])[plan.prefill_valid]
    return out

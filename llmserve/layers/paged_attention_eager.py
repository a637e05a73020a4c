"""Paged attention with the score matrix materialized: ALiBi biases, sliding windows and logit
soft-capping, which SDPA and the fused kernels do not take. Any backend falls back to it.

Each sequence attends on its own (a Python loop over sequences, not tokens). Its keys are
gathered from the pool starting at the first block a query can still see:

    window 6, block 4, queries at 9..10:    keys 4..10 visible -> blocks 1..2 gathered
    positions   0 1 2 3 | 4 5 6 7 | 8 9 10
                 block 0  block 1   block 2

    scores[h, i, j] = softcap(q_i . k_j * scale) + slope_h * (pos_j - pos_i)
    masked unless  pos_j <= pos_i  and  pos_i - pos_j < window
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.layers import kv_quant
from llmserve.layers.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class ScoreOptions:
    """What the eager path adds to plain causal attention (None: that feature is off)."""

    scale: float
    sliding_window: int | None = None  # a query sees its own and the window - 1 keys before
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    alibi_slopes: torch.Tensor | None = None  # [num_heads] float32
    k_scale: float = 1.0  # a quantized pool's scales (layers/kv_quant.py)
    v_scale: float = 1.0


def _context_start(first_query_pos: int, window: int | None, block_size: int) -> int:
    """First key position gathered: the start of the block holding the oldest visible key."""
    if window is None:
        return 0
    return max(0, first_query_pos - window + 1) // block_size * block_size


def _gather_context(cache: torch.Tensor, table: torch.Tensor, start: int, end: int):
    """Keys (or values) at positions ``start..end-1`` of one sequence -> ``[end - start, kvh, D]``."""
    block_size = cache.shape[1]
    blocks = table[start // block_size : -(-end // block_size)].long()
    rows = cache[blocks].flatten(0, 1)  # [num_blocks * bs, kvh, D]
    return rows[: end - start]


def attend_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    opts: ScoreOptions,
) -> torch.Tensor:
    """q ``[q_len, H, D]``, k/v ``[ctx, kvh, D]``, positions ``[q_len]``/``[ctx]`` -> ``[q_len, H, D]``."""
    num_heads, kv_heads = q.shape[1], k.shape[1]
    group = num_heads // kv_heads
    qh = q.float().transpose(0, 1)  # [H, q_len, D]
    kh = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, ctx, D]
    vh = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    scores = qh @ kh.transpose(1, 2) * opts.scale  # [H, q_len, ctx]
    if opts.softcap is not None:
        scores = torch.tanh(scores / opts.softcap) * opts.softcap
    distance = q_pos[:, None] - k_pos[None, :]  # [q_len, ctx]
    if opts.alibi_slopes is not None:
        scores = scores - opts.alibi_slopes.float()[:, None, None] * distance
    visible = distance >= 0
    if opts.sliding_window is not None:
        visible &= distance < opts.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vh).transpose(0, 1).to(q.dtype)  # [q_len, H, D]


def paged_attention_eager(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    opts: ScoreOptions,
) -> torch.Tensor:
    """q ``[num_tokens, H, D]`` (this step's K/V already in the pool) -> ``[num_tokens, H, D]``."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    start = 0
    for i, (q_len, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        rows = slice(start, start + q_len)
        start += q_len
        if ctx == 0:  # a padding row
            out[rows] = 0
            continue
        first = _context_start(ctx - q_len, opts.sliding_window, block_size)
        table = meta.block_tables[i]
        ki = _gather_context(k_cache, table, first, ctx)  # [ctx - first, kvh, D]
        vi = _gather_context(v_cache, table, first, ctx)
        ki = kv_quant.dequantize(ki, q.dtype, opts.k_scale)
        vi = kv_quant.dequantize(vi, q.dtype, opts.v_scale)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        k_pos = torch.arange(first, ctx, device=q.device)
        out[rows] = attend_eager(q[rows], ki, vi, q_pos, k_pos, opts)
    return out

"""Paged attention in plain torch: vectorized over sequences, for CPU (and as a fallback).

Each path gathers the sequences' K/V out of the pool through their block tables and runs
``scaled_dot_product_attention`` over the padded batch. Grouped-query attention needs no
copy of K/V per query head: the ``G = num_heads // num_kv_heads`` query heads of a group are
folded into the query-length axis (query head h reads KV head h // G),

    q: [B, kv_heads, G * q_len, D]   k, v: [B, kv_heads, ctx, D]   mask: [B, 1, G * q_len, ctx]

Decode (one query per sequence) is memory-bound: it reads every cached K/V once. Gathering
the whole batch first would write the copy to memory and read it back (three passes over
the data); instead the batch is cut into *tiles* of consecutive sequences whose gathered K/V
fit in cache (``TILE_BYTES_PER_THREAD`` x threads), each gathered into one reused buffer
and attended while it is still in cache:

    decodes  d0 d1 d2 d3 d4 d5 d6 d7     tile = as many sequences as the budget holds
             [  tile 0  ][  tile 1  ]    (all of them at short contexts; at least one per
                                          thread at very long ones, so every thread has work)
    a tile gathers ceil(longest context / block_size) blocks per sequence, and needs no mask
    when all its contexts have the same length.

The number of tiles is the batch's K/V bytes over the budget, not the number of sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from llmserve.runner.attention_metadata import AttentionMetadata

TILE_BYTES_PER_THREAD = 2 << 20  # gathered K + V per decode tile, per thread: about one L2


@dataclass
class DecodeTile:
    """Decodes ``start:end`` attended together over ``num_blocks`` gathered blocks each."""

    start: int
    end: int
    num_blocks: int
    seq_len: int | None  # the common context length, or None when lengths differ (mask)


@dataclass
class TorchAttentionPlan:
    """Index tensors built once per step and shared by every layer."""

    block_size: int
    decode_seq_lens: list[int]  # host copy, sizes the tiles
    decode_tables: torch.Tensor  # [num_decodes, num_blocks_d] block ids
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, ctx_d] bool, True = attend
    prefill_tables: torch.Tensor  # [num_prefills, num_blocks_p]
    prefill_mask: torch.Tensor  # [num_prefills, 1, max_q, ctx_p] bool
    prefill_q_index: torch.Tensor  # [num_prefills, max_q] token index of each padded query
    prefill_valid: torch.Tensor  # [num_prefills * max_q] bool, real (not padding) queries
    prefill_is_causal: bool  # no prefill has cached context before it: SDPA's own causal mask
    # Filled by the first layer (they depend on the KV pool's shape and dtype), then reused.
    tiles: list[DecodeTile] | None = None
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # gather scratch for K and V
    grouped_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # G -> folded mask


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
        max=max(sum(meta.query_lens_cpu) - 1, 0)
    )
    return TorchAttentionPlan(
        block_size=block_size,
        decode_seq_lens=meta.seq_lens_cpu[:nd],
        decode_tables=meta.block_tables[:nd, :d_blocks].long(),  # int64: index_select's fast path
        decode_mask=decode_mask[:, None, None, :],
        prefill_tables=meta.block_tables[nd:, :p_blocks],
        prefill_mask=prefill_mask[:, None, :, :],
        prefill_q_index=q_index,
        prefill_valid=valid.reshape(-1),
        prefill_is_causal=q_lens == meta.seq_lens_cpu[nd:],
    )


def plan_decode_tiles(
    seq_lens: list[int], block_size: int, tile_tokens: int, min_seqs: int = 1
) -> list[DecodeTile]:
    """Cut the decodes into runs of consecutive sequences of at most ``tile_tokens`` gathered
    tokens each (but at least ``min_seqs`` sequences), every sequence padded to its tile's
    longest context."""
    tiles: list[DecodeTile] = []
    start = 0
    while start < len(seq_lens):
        end, longest = start, 0
        while end < len(seq_lens):
            blocks = -(-max(longest, seq_lens[end]) // block_size)
            over = blocks * block_size * (end - start + 1) > tile_tokens
            if end - start >= min_seqs and over:
                break
            longest = max(longest, seq_lens[end])
            end += 1
        lens = seq_lens[start:end]
        same = lens[0] if all(n == lens[0] for n in lens) else None
        tiles.append(DecodeTile(start, end, -(-longest // block_size), same))
        start = end
    return tiles


def _prepare_decode(plan: TorchAttentionPlan, k_cache: torch.Tensor) -> None:
    """Size the tiles for this pool's bytes per token and allocate the gather buffers."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    bytes_per_token = 2 * kv_heads * head_dim * k_cache.element_size()
    threads = torch.get_num_threads()  # SDPA splits a tile's (sequence, KV head) pairs
    budget = TILE_BYTES_PER_THREAD * threads // bytes_per_token
    if k_cache.device.type != "cpu":  # a GPU gains nothing from tiles, and pays per launch
        budget = 1 << 62
    plan.tiles = plan_decode_tiles(plan.decode_seq_lens, block_size, budget, threads)
    num_blocks = max((t.num_blocks * (t.end - t.start) for t in plan.tiles), default=0)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    plan.buffers = (
        torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device),
        torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device),
    )


def _gather_kv(cache: torch.Tensor, tables: torch.Tensor, out: torch.Tensor | None = None):
    """``cache: [num_blocks, bs, kvh, D]``, ``tables: [B, nb]`` -> ``[B, kvh, nb * bs, D]``.

    The result is a strided view of ``out`` (or of a new tensor), not a contiguous copy.
    """
    batch, num_blocks = tables.shape
    num_pool_blocks, block_size, kv_heads, head_dim = cache.shape
    flat = tables.reshape(-1)
    rows = cache.view(num_pool_blocks, -1)  # [num_blocks, bs * kvh * D]: one memcpy per block
    if out is not None:
        out = out.view(out.shape[0], -1)[: flat.shape[0]]
        torch.index_select(rows, 0, flat, out=out)  # [B * nb, bs * kvh * D]
    else:
        out = rows.index_select(0, flat)
    return out.view(batch, num_blocks * block_size, kv_heads, head_dim).transpose(1, 2)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    """q ``[num_decodes, H, D]`` -> ``out [num_decodes, H, D]``, one tile at a time."""
    if plan.tiles is None:
        _prepare_decode(plan, k_cache)
    assert plan.tiles is not None and plan.buffers is not None
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    q = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)  # [nd, kvh, G, D]
    for tile in plan.tiles:
        rows = slice(tile.start, tile.end)
        tables = plan.decode_tables[rows, : tile.num_blocks]  # [n, nb]
        k = _gather_kv(k_cache, tables, plan.buffers[0])  # [n, kvh, nb * bs, D]
        v = _gather_kv(v_cache, tables, plan.buffers[1])
        if tile.seq_len is not None:
            k, v, mask = k[:, :, : tile.seq_len], v[:, :, : tile.seq_len], None
        else:
            mask = plan.decode_mask[rows, ..., : k.shape[2]]  # [n, 1, 1, ctx]
        o = F.scaled_dot_product_attention(q[rows], k, v, attn_mask=mask, scale=scale)
        out[rows] = o.view(tile.end - tile.start, num_heads, head_dim)


def _grouped_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q ``[B, q_len, H, D]``, k/v ``[B, kvh, ctx, D]``, mask ``[B, 1, G * q_len, ctx]`` -> ``[B, q_len, H, D]``."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    q = q.view(batch, q_len, kv_heads, group, head_dim).permute(
        0, 2, 3, 1, 4
    )  # [B, kvh, G, q_len, D]
    q = q.reshape(batch, kv_heads, group * q_len, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, kvh, G*q, D]
    out = out.view(batch, kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, num_heads, head_dim)


def _causal_prefill(
    q_pad: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Whole prompts, right-padded: q ``[np, max_q, H, D]``, k/v ``[np, kvh, >= max_q, D]``.

    ``is_causal`` lets SDPA skip the masked half instead of computing and masking it. The
    padding needs no mask: a padded key sits after every real query of its row, so only
    padded queries (whose outputs are dropped) can see it.
    """
    max_q = q_pad.shape[1]
    q = q_pad.transpose(1, 2)  # [np, H, max_q, D]
    k, v = k[:, :, :max_q], v[:, :, :max_q]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)  # [np, max_q, H, D]


def _grouped_mask(plan: TorchAttentionPlan, group: int) -> torch.Tensor:
    """The prefill mask repeated for the G folded query heads: ``[np, 1, G * max_q, ctx]``."""
    if group not in plan.grouped_masks:
        mask = plan.prefill_mask  # [np, 1, max_q, ctx]
        batch, _, max_q, ctx = mask.shape
        plan.grouped_masks[group] = mask.expand(batch, group, max_q, ctx).reshape(
            batch, 1, group * max_q, ctx
        )
    return plan.grouped_masks[group]


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
        _decode(q[:nd], k_cache, v_cache, plan, scale, out[:nd])
    if meta.num_seqs > nd:
        k = _gather_kv(k_cache, plan.prefill_tables)
        v = _gather_kv(v_cache, plan.prefill_tables)
        q_pad = q[plan.prefill_q_index]  # [np, max_q, H, D]
        if plan.prefill_is_causal:
            o = _causal_prefill(q_pad, k, v, scale)
        else:
            mask = _grouped_mask(plan, q.shape[1] // k_cache.shape[2])
            o = _grouped_sdpa(q_pad, k, v, mask, scale)  # [np, max_q, H, D]
        out[nd:] = o.reshape(-1, *q.shape[1:])[plan.prefill_valid]
    return out

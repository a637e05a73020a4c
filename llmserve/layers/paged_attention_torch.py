"""Paged attention for the ``torch`` and ``cpp`` backends (CPU, and a fallback anywhere).

Decode (one query per sequence) is memory-bound: it reads every cached K/V once.

* ``cpp``: the C++ kernel (``llmserve/kernels/cpu``) walks each sequence's block table and
  reads the blocks in place; nothing is copied.
* ``torch``: the sequences' K/V are gathered out of the pool and attended by
  ``scaled_dot_product_attention``. Gathering the whole batch first would write the copy to
  memory and read it back (three passes over the data); instead the batch is cut into
  *tiles* of consecutive sequences whose gathered K/V fit in cache (``TILE_BYTES_PER_THREAD``
  x threads), each gathered into one reused buffer and attended while it is still in cache:

      decodes  d0 d1 d2 d3 d4 d5 d6 d7     tile = as many sequences as the budget holds
               [  tile 0  ][  tile 1  ]    (all of them at short contexts; at least one per
                                            thread at very long ones, so every thread has work)

  A tile gathers ceil(longest context / block_size) blocks per sequence, and needs no mask
  when all its contexts have the same length. Grouped-query attention needs no copy of K/V
  per query head: the ``G = num_heads // num_kv_heads`` query heads of a group are folded
  into the query-length axis (query head h reads KV head h // G).

Prefill (``torch``; ``cpp`` steps with prompts take the C++ ``paged_attention`` from
``Attention.forward`` instead, unless they need the eager path) attends one prompt chunk at a
time, so nothing is padded to the longest chunk: a chunk with no cached context before it
uses SDPA's causal kernel on this step's own K/V (no gather, no mask, the masked half skipped); a chunk that continues a context
(chunked prefill, a prefix-cache hit) gathers its blocks and gets a mask of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers import kv_quant
from llmserve.layers.attention_metadata import AttentionMetadata

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
    native_decode: bool  # decodes through the C++ kernel (llmserve/kernels/cpu), else tiles
    decode_seq_lens_cpu: list[int]  # host copy, sizes the tiles
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    # [num_decodes, num_blocks_d] block ids: int32 for the C++ kernel, int64 for the tiles
    # (index_select's fast path)
    decode_tables: torch.Tensor
    decode_mask: torch.Tensor | None  # tiles only: [num_decodes, 1, 1, ctx_d] bool, True = attend
    # Per prefill chunk: None when it has no cached context before it (SDPA's causal kernel
    # on this step's K/V), else (block ids of its context, mask [q_len, ctx] bool).
    prefills: list[tuple[torch.Tensor, torch.Tensor] | None]
    # Filled by the first layer (they depend on the KV pool's shape and dtype), then reused.
    tiles: list[DecodeTile] | None = None
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # gather scratch for K and V


def build_plan(
    meta: AttentionMetadata, block_size: int, native_decode: bool = False
) -> TorchAttentionPlan:
    device = meta.block_tables.device
    nd = meta.num_decodes
    d_blocks = -(-max(meta.seq_lens_cpu[:nd], default=0) // block_size)
    decode_tables = meta.block_tables[:nd, :d_blocks]  # [nd, d_blocks]
    decode_mask = None
    if native_decode:
        decode_tables = decode_tables.contiguous()
    else:
        decode_tables = decode_tables.long()
        positions = torch.arange(d_blocks * block_size, device=device)
        decode_mask = (positions[None, :] < meta.seq_lens[:nd, None])[:, None, None, :]
    prefills: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for i in range(nd, meta.num_seqs):
        q_len, ctx = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        if q_len == ctx:
            prefills.append(None)
            continue
        # query j sits at position ctx - q_len + j and sees keys 0..that position
        mask = torch.ones(q_len, ctx, dtype=torch.bool, device=device).tril(ctx - q_len)
        prefills.append((meta.block_tables[i, : -(-ctx // block_size)].long(), mask))
    return TorchAttentionPlan(
        block_size=block_size,
        native_decode=native_decode,
        decode_seq_lens_cpu=meta.seq_lens_cpu[:nd],
        decode_seq_lens=meta.seq_lens[:nd],
        decode_tables=decode_tables,
        decode_mask=decode_mask,
        prefills=prefills,
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
    plan.tiles = plan_decode_tiles(plan.decode_seq_lens_cpu, block_size, budget, threads)
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
    kv_scales: tuple[float, float],
) -> None:
    """q ``[num_decodes, H, D]`` -> ``out [num_decodes, H, D]``, one tile at a time."""
    k_scale, v_scale = kv_scales
    if plan.native_decode:  # in place through the block tables, no gathered copy
        cpu_kernels.paged_decode_attention(
            q.contiguous(), k_cache, v_cache, plan.decode_tables, plan.decode_seq_lens, scale,
            out, 0, k_scale, v_scale,
        )  # fmt: skip
        return
    if plan.tiles is None:
        _prepare_decode(plan, k_cache)
    assert plan.tiles is not None and plan.buffers is not None and plan.decode_mask is not None
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
        k = kv_quant.dequantize(k, q.dtype, k_scale)
        v = kv_quant.dequantize(v, q.dtype, v_scale)
        o = F.scaled_dot_product_attention(q[rows], k, v, attn_mask=mask, scale=scale)
        out[rows] = o.view(tile.end - tile.start, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: TorchAttentionPlan,
    scale: float,
    out: torch.Tensor,
    kv_scales: tuple[float, float],
) -> None:
    """Each prompt chunk attends on its own, so nothing is padded to the longest chunk. A
    chunk with no cached context before it attends over this step's K/V with SDPA's causal
    kernel (which skips the masked half); one that continues a context (chunked prefill, a
    prefix-cache hit) gathers its blocks and uses its own mask."""
    start = 0
    for i, prefill in enumerate(plan.prefills):
        q_len = meta.query_lens_cpu[meta.num_decodes + i]
        rows = slice(start, start + q_len)
        start += q_len
        qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if prefill is None:  # (a narrower pool: the values as it holds them, as later reads)
            ki = kv_quant.round_trip(k[rows], k_cache.dtype, kv_scales[0])
            vi = kv_quant.round_trip(v[rows], v_cache.dtype, kv_scales[1])
            ki = ki.transpose(0, 1).unsqueeze(0)  # [1, kvh, q_len, D]
            vi = vi.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            table, mask = prefill
            ctx = mask.shape[1]
            ki = _gather_kv(k_cache, table[None])[:, :, :ctx]  # [1, kvh, ctx, D]
            vi = _gather_kv(v_cache, table[None])[:, :, :ctx]
            ki = kv_quant.dequantize(ki, q.dtype, kv_scales[0])
            vi = kv_quant.dequantize(vi, q.dtype, kv_scales[1])
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[rows] = o[0].transpose(0, 1)


def paged_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: TorchAttentionPlan,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q ``[num_tokens, H, D]``, this step's k/v ``[num_tokens, kvh, D]`` (already written to
    the pool too) -> ``[num_tokens, H, D]``. A pool narrower than q's dtype is read back
    times ``k_scale`` / ``v_scale`` (layers/kv_quant.py)."""
    out = torch.empty_like(q)
    nd, scales = meta.num_decodes, (k_scale, v_scale)
    if nd:
        _decode(q[:nd], k_cache, v_cache, plan, scale, out[:nd], scales)
    if meta.num_seqs > nd:
        _prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, plan, scale, out[nd:], scales)
    return out

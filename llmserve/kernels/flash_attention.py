"""Triton FlashAttention forward for packed, variable-length, causal prefill over a paged KV pool.

One program handles BLOCK_M query tokens of one (sequence, query head) and walks that
sequence's keys BLOCK_N at a time through its block table, keeping a running max and sum
(online softmax), so no [q_len, seq_len] matrix is ever stored. Because keys are read from
the pool, a chunk whose earlier positions are already cached (chunked prefill, prefix hit)
needs nothing special: its queries are the last q_len positions of the context.

    grid = (cdiv(max_query_len, BLOCK_M), num_seqs * num_heads)

    seq b:  context positions 0 ............................ seq_len-1
                              [cached / earlier chunks][ this step's q_len ]
            query block m covers positions ctx_start + m*BLOCK_M .. + BLOCK_M-1 and reads
            keys 0 .. min(seq_len, ctx_start + (m+1)*BLOCK_M) - 1: whole key tiles before
            its first position with no mask, the tiles on the diagonal masked causally.

Scores are kept in log2 units (scale * log2(e) folded into one multiply) so the softmax runs
on exp2; query blocks are launched last-first (the longest rows start first); the launch
shape is a TileConfig (default_tile; ``llmserve bench attention --sweep-tiles`` times others).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are kept in log2 units so the softmax runs on exp2


class TileConfig(NamedTuple):
    """How a kernel is launched: query rows and keys per tile, warps, software-pipeline depth."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


def default_tile(head_dim_pad: int, dtype: torch.dtype) -> TileConfig:
    """The fastest tile of ``llmserve bench attention --sweep-tiles`` (bf16, head dim 64, 16k
    tokens: 128 x 64, 8 warps, 2 stages; 1.26x faster than 64 x 64 with 4 warps on an H100,
    1.26x on an H200), smaller ones where fp32 (twice the bytes) or a head above 128 would
    overflow shared memory."""
    if head_dim_pad > 128:
        return TileConfig(32, 32)
    if dtype == torch.float32:
        return TileConfig(64, 64)
    return TileConfig(128, 64, num_warps=8, num_stages=2)


def dot_precision(dtype: torch.dtype) -> str | None:
    """tl.dot's input_precision: exact products for fp32 (the default rounds them to tf32 on
    NVIDIA GPUs), the default for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else None


@triton.jit
def load_kv_tile(
    cache_ptr,
    block_table_ptr,  # this sequence's row of block_tables
    offs_n,  # [BLOCK_N] key positions
    offs_d,  # [HEAD_DIM_PAD]
    n_mask,  # [BLOCK_N] positions inside the context
    d_mask,  # [HEAD_DIM_PAD] real (unpadded) head dims
    kv_head,
    block_size,
    stride_cb,
    stride_cs,
    stride_ch,
):
    """Gather keys (or values) at positions offs_n: [BLOCK_N, HEAD_DIM_PAD]."""
    blocks = tl.load(block_table_ptr + offs_n // block_size, mask=n_mask, other=0)
    row = blocks.to(tl.int64) * stride_cb + (offs_n % block_size) * stride_cs  # [BLOCK_N]
    ptrs = cache_ptr + row[:, None] + kv_head * stride_ch + offs_d[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32, unnormalized output so far
    l_i,  # [BLOCK_M] running sum of exp2
    m_i,  # [BLOCK_M] running max (log2 units)
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    start_n,
    kv_end,
    query_pos,  # [BLOCK_M] context position of each query row
    offs_d,
    d_mask,
    kv_head,
    block_size,
    stride_cb,
    stride_cs,
    stride_ch,
    qk_scale,  # softmax scale * log2(e): scores in log2 units, so exp2 does the softmax
    slope_log2,  # ALiBi slope * log2(e): a scalar, or [BLOCK_M, 1] per row (unused without)
    HAS_ALIBI: tl.constexpr,
    MASKED: tl.constexpr,  # False for tiles every row sees whole: no causal or bounds mask
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N tile of keys/values folded into the online softmax (prefill rows are query
    tokens of one head; decode rows are the query heads of one KV head, at one position)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    n_mask = offs_n < kv_end
    k = load_kv_tile(
        k_cache_ptr, table_ptr, offs_n, offs_d, n_mask, d_mask, kv_head,
        block_size, stride_cb, stride_cs, stride_ch,
    )  # fmt: skip
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    rel = offs_n[None, :] - query_pos[:, None]  # [BLOCK_M, BLOCK_N], key_pos - query_pos
    if HAS_ALIBI:
        s += slope_log2 * rel.to(tl.float32)
    if MASKED:
        s = tl.where((rel <= 0) & n_mask[None, :], s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: a row's first tile has a visible key
    p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = load_kv_tile(
        v_cache_ptr, table_ptr, offs_n, offs_d, n_mask, d_mask, kv_head,
        block_size, stride_cb, stride_cs, stride_ch,
    )  # fmt: skip
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # [BLOCK_M, HEAD_DIM_PAD]
    return acc * alpha[:, None] + pv, l_i, m_new


@triton.jit
def _flash_attn_varlen_paged_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    alibi_slopes_ptr,
    qk_scale,
    num_heads,
    num_queries_per_kv,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    HAS_ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: tl.dot would round them to tf32
):
    # Query blocks run last-first: the late ones see the most keys, so they start early and
    # the short ones fill in behind them instead of leaving a long tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1) // num_heads
    head = tl.program_id(1) % num_heads
    kv_head = head // num_queries_per_kv

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # position of this chunk's first query token

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index within the chunk
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < head_dim
    m_mask = offs_m < q_len
    tokens = (q_start + offs_m).to(tl.int64)  # [BLOCK_M] rows of q / out
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    query_pos = ctx_start + offs_m  # [BLOCK_M]
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(alibi_slopes_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first_query = ctx_start + pid_m * BLOCK_M  # every row of the block sees keys before it
    kv_end = tl.minimum(seq_len, first_query + BLOCK_M)  # last key this block sees, plus one
    # Whole tiles below the block's first query need no causal mask; the rest (the diagonal,
    # at most BLOCK_M / BLOCK_N + 1 tiles) does.
    unmasked_end = (first_query // BLOCK_N) * BLOCK_N
    for start_n in range(0, unmasked_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start_n, kv_end, query_pos,
            offs_d, d_mask, kv_head, block_size, stride_cb, stride_cs, stride_ch, qk_scale,
            slope_log2, HAS_ALIBI, False, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip
    for start_n in range(unmasked_end, kv_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start_n, kv_end, query_pos,
            offs_d, d_mask, kv_head, block_size, stride_cb, stride_cs, stride_ch, qk_scale,
            slope_log2, HAS_ALIBI, True, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip

    acc = acc / l_i[:, None]
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def flash_attn_varlen_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    alibi_slopes: torch.Tensor | None = None,
    tile: TileConfig | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over the paged KV pool (same contract as the reference).

    q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; query_start_loc: [num_seqs + 1] int32; seq_lens: [num_seqs] int32
    (context length including this step's tokens); block_tables: [num_seqs, max_blocks] int32;
    max_query_len: the longest query chunk (sizes the grid without a device sync). tile: launch
    shape (None: default_tile's; benchmarks sweep others).
    Returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, heads, dim]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile = tile or default_tile(head_dim_pad, q.dtype)
    grid = (triton.cdiv(max_query_len, tile.block_m), num_seqs * num_heads)
    _flash_attn_varlen_paged_kernel[grid](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_tables,
        alibi_slopes if alibi_slopes is not None else q,
        scale * LOG2E, num_heads, num_heads // num_kv_heads, head_dim, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        HAS_ALIBI=alibi_slopes is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        HEAD_DIM_PAD=head_dim_pad,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )  # fmt: skip
    return out

"""Triton split-K paged decode attention (flash-decoding): one query token per sequence.

Stage 1: grid (num_seqs, num_kv_heads, num_splits). Each program takes one KV head, all
query heads of its group at once (so each K/V tile is loaded once per group), and one
contiguous chunk of the context; it writes a partial (max, sum, unnormalized acc).
Stage 2: grid (num_seqs, num_heads) rescales the partials to a common max and divides.

    seq_len = 37, num_splits = 3, BLOCK_N = 16 -> chunk = 16 tokens (rounded up to BLOCK_N)
    positions:  0 ........ 15 | 16 ........ 31 | 32 .. 36
                   split 0        split 1         split 2
    a split that starts past seq_len writes (max=-inf, sum=0, acc=0) and drops out in stage 2.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .flash_attention import LOG2E, TileConfig, attend_tile, dot_precision

# block_m is unused here: a program's rows are the query heads that share one KV head.
DEFAULT_TILE = TileConfig(block_m=1, block_n=64)
_MAX_SPLITS = 16


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    alibi_slopes_ptr,
    part_max_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32
    part_sum_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32
    part_acc_ptr,  # [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32
    qk_scale,  # softmax scale * log2(e): scores in log2 units for exp2
    num_heads,
    num_queries_per_kv,
    head_dim,
    block_size,
    stride_qs,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    HAS_ALIBI: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: tl.dot would round them to tf32
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = split * chunk
    split_end = tl.minimum(split_start + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD] query heads of this KV head
    g_mask = offs_g < num_queries_per_kv
    heads = kv_head * num_queries_per_kv + offs_g  # [GROUP_PAD]
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < head_dim
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, D_PAD]
    slopes_log2 = 0.0
    if HAS_ALIBI:
        slopes = tl.load(alibi_slopes_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
        slopes_log2 = slopes[:, None] * 1.4426950408889634  # log2(e); [GROUP_PAD, 1]
    query_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)  # every head's position

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(split_start, split_end, BLOCK_N):  # masked: the last tile ends early
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start_n, split_end, query_pos,
            offs_d, d_mask, kv_head, block_size, stride_cb, stride_cs, stride_ch, qk_scale,
            slopes_log2, HAS_ALIBI, True, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip

    part = (seq * num_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD] flat (seq, head, split)
    tl.store(part_max_ptr + part, m_i, mask=g_mask)
    tl.store(part_sum_ptr + part, l_i, mask=g_mask)
    acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :]
    tl.store(acc_ptrs, acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    out_ptr,
    num_heads,
    head_dim,
    stride_os,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    part = (seq * num_heads + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    m = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=s_mask[:, None], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]

    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # seq_len 0 (a padding row)
    w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)  # [SPLITS_PAD]; empty splits give exp(-inf)=0
    total = tl.sum(l_s * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM_PAD]
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


@functools.lru_cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits that (seqs x KV heads x splits) fills the GPU about twice over."""
    if device.type == "cuda":
        num_programs = 2 * _num_sms(device.index if device.index is not None else 0)
    else:
        num_programs = 8  # interpreter: a few splits, so tests cover the reduction
    return max(1, min(_MAX_SPLITS, triton.cdiv(num_programs, max(1, num_seqs * num_kv_heads))))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile: TileConfig | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence (at position seq_len - 1) over the paged KV pool.

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; seq_lens: [num_seqs] int32 (a padding row with seq_len 0 gets
    zeros); block_tables: [num_seqs, max_blocks] int32. num_splits: chunks per sequence
    (None: picked from the batch shape). tile: launch shape (None: DEFAULT_TILE; benchmarks
    sweep others).
    Returns [num_seqs, num_heads, head_dim] in q's dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_seqs, heads, dim]
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    tile = tile or DEFAULT_TILE
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(*part_max.shape, head_dim_pad, dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, seq_lens, block_tables,
        alibi_slopes if alibi_slopes is not None else q,
        part_max, part_sum, part_acc,
        scale * LOG2E, num_heads, group, head_dim, block_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        HAS_ALIBI=alibi_slopes is not None,
        NUM_SPLITS=num_splits,
        BLOCK_N=tile.block_n,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM_PAD=head_dim_pad,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )  # fmt: skip
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_max, part_sum, part_acc, out, num_heads, head_dim, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM_PAD=head_dim_pad,
    )  # fmt: skip
    return out

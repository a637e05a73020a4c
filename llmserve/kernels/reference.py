"""Plain-torch references for every kernel: slow, loop-based where that is clearer, used by tests.

KV pool layout (see ``llmserve/layers/attention_metadata.py``):

    k_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    position p of sequence b lives at block_tables[b][p // block_size], offset p % block_size
"""

from __future__ import annotations

import torch


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """Read positions 0..seq_len-1 of one sequence out of the paged pool."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_table.long()[positions // block_size]  # [seq_len]
    return cache[blocks, positions % block_size]


def _attend_one_seq(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim], fp32
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [num_heads, q_len, seq_len]
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [q_len]
    key_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
    rel = (key_pos[None, :] - query_pos[:, None]).float()  # [q_len, seq_len], <= 0 where allowed
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.float()[:, None, None] * rel
    hidden = rel > 0
    if sliding_window is not None:  # a query sees its own and the window - 1 keys before it
        hidden |= rel <= -sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def ref_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over a paged KV pool.

    q: [num_tokens, num_heads, head_dim]; sequence b owns tokens
    query_start_loc[b]:query_start_loc[b+1], the last q_len positions of its seq_lens[b]-long
    context. Query head h reads KV head h // (num_heads // num_kv_heads). With ALiBi the score
    gets slope[h] * (key_pos - query_pos); with a sliding window W a query at position p sees
    keys p - W + 1 .. p only. Returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len)
        v = gather_kv(v_cache, block_tables[b], seq_len)
        attended = _attend_one_seq(q[start:end], k, v, scale, alibi_slopes, sliding_window)
        out[start:end] = attended.to(q.dtype)
    return out


def ref_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual``, returns (norm(x + residual), x + residual)."""
    if residual is not None:
        summed = (x.float() + residual.float()).to(x.dtype)
        return ref_rms_norm(summed, weight, eps), summed
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:], [..., d]."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def _rotate(
    x: torch.Tensor,  # [T, H, head_dim]
    cos: torch.Tensor,  # [T, rot_dim // 2]
    sin: torch.Tensor,  # [T, rot_dim // 2]
    is_neox: bool,
) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)  # halves
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]  # interleaved pairs (GPT-J)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, rot_dim // 2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if is_neox:
        rotated = torch.cat([o1, o2], dim=-1)
    else:
        rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), x_pass], dim=-1)


def ref_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding; returns new (q, k) shaped like the inputs.

    q: [T, num_heads * head_dim] or [T, num_heads, head_dim], k likewise with KV heads.
    cos_sin_cache: [max_pos, rot_dim], cos in the first half, sin in the second. 2-D inputs
    are split into heads of rot_dim; 3-D inputs rotate the first rot_dim dims of each head.
    """
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rot_dim // 2] each

    def apply(x: torch.Tensor) -> torch.Tensor:
        x3 = x.view(x.shape[0], -1, rot_dim) if x.dim() == 2 else x
        return _rotate(x3, cos, sin, is_neox).view(x.shape)

    return apply(q), apply(k)


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, num_kv_heads, head_dim] into the pool at their slots (-1: skip)."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[t]
        v_cache[block, offset] = value[t]

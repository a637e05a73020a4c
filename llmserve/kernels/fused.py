"""Triton kernels for the small fused ops around attention: one program per token (row).

    rms_norm            (x [+ residual]) -> norm, and the new residual, in one pass
    silu_and_mul        [..., 2d] -> silu(gate) * up, [..., d]
    rotary_embedding_   neox-style rotary on q and k, in place (works on views of a fused qkv)
    reshape_and_cache   new K/V [T, num_kv_heads, head_dim] -> their slots in the paged pool

All compute in fp32 and store in the output's dtype; the references live in reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = x.to(residual_out_ptr.dtype.element_ty)  # the norm reads the stored residual
        tl.store(residual_out_ptr + row * hidden + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (x * inv_rms * w).to(out_ptr.dtype.element_ty)  # [BLOCK]
    tl.store(out_ptr + row * hidden + offs, out, mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual``, returns (norm(x + residual), x + residual).

    Inputs are not modified; fp32 inside, results in x's dtype.
    """
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # [num_rows, hidden]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = residual.reshape(-1, hidden) if residual is not None else x2  # [num_rows, hidden]
    res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
    res_out = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, hidden, eps, x2.stride(0), res2.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 512, 1), 16),
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up  # [BLOCK]
    tl.store(out_ptr + row * d + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:], [..., d] in x's dtype."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # [num_rows, 2 * d]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and d > 0:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, d, x2.stride(0), BLOCK=block
        )
    return out


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_t,
    stride_h,
    num_heads,
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    """Rotate dims [0, HALF) against [HALF, 2 * HALF) of every head of one token, in place."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_i = tl.arange(0, HALF_PAD)
    mask = (offs_h < num_heads)[:, None] & (offs_i < HALF)[None, :]  # [HEADS_PAD, HALF_PAD]
    ptrs1 = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_i[None, :]
    ptrs2 = ptrs1 + HALF
    x1 = tl.load(ptrs1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs2, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(ptrs1, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs2, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    i_mask = offs_i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cache + offs_i, mask=i_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + offs_i, mask=i_mask, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)  # [HALF_PAD]
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin,
                  HALF, HALF_PAD, Q_HEADS_PAD)  # fmt: skip
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, num_k_heads, cos, sin,
                  HALF, HALF_PAD, K_HEADS_PAD)  # fmt: skip


def _as_heads(x: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """A [T, H, head_dim] view of x without copying (2-D inputs use head_dim = rot_dim)."""
    x3 = x.view(x.shape[0], -1, rot_dim) if x.dim() == 2 else x
    assert x3.stride(-1) == 1, "rotary needs the head dim contiguous"
    return x3


def rotary_embedding_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Neox-style rotary embedding applied in place to q and k.

    positions: [T]; q: [T, num_heads * head_dim] or [T, num_heads, head_dim], k likewise with
    KV heads (views into a fused qkv are fine); cos_sin_cache: [max_pos, rot_dim], cos in the
    first half, sin in the second. 3-D inputs rotate the first rot_dim dims of each head
    (partial rotary); 2-D inputs are split into heads of rot_dim.
    """
    rot_dim = cos_sin_cache.shape[-1]
    q3, k3 = _as_heads(q, rot_dim), _as_heads(k, rot_dim)  # [T, H, head_dim], [T, KVH, head_dim]
    assert cos_sin_cache.stride(-1) == 1
    if positions.numel() == 0:
        return
    half = rot_dim // 2
    _rotary_kernel[(positions.numel(),)](
        positions, q3, k3, cos_sin_cache, q3.shape[1], k3.shape[1],
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos_sin_cache.stride(0),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(q3.shape[1]),
        K_HEADS_PAD=triton.next_power_of_2(k3.shape[1]),
    )  # fmt: skip


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    head_dim,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :]
    src = token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    key = tl.load(key_ptr + src, mask=mask)  # [HEADS_PAD, HEAD_DIM_PAD]
    src = token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    value = tl.load(value_ptr + src, mask=mask)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, num_kv_heads, head_dim] into the pool at their slots (-1: skip).

    slot = block * block_size + offset, with k_cache/v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: [T] int32 or int64.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip

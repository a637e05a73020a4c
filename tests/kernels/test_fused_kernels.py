"""Triton rms_norm, silu_and_mul, rotary_embedding_, reshape_and_cache against the references."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import cos_sin_cache, tolerance

from llmserve.kernels.reference import (
    ref_reshape_and_cache,
    ref_rms_norm,
    ref_rotary,
    ref_silu_and_mul,
)

# bf16 is covered here but not in the attention tests: the interpreter's tl.dot on bf16 is
# wrong, and it casts fp32 to bf16 by truncation (one ulp off; within tolerance).
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 80), (2, 3, 256)])
def test_rms_norm_matches_reference(kernels, dtype, shape):
    x, weight = torch.randn(shape).to(dtype), torch.randn(shape[-1]).to(dtype)
    out = kernels.rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref_rms_norm(x, weight, 1e-6), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference(kernels, dtype):
    x, residual = torch.randn(7, 96).to(dtype), torch.randn(7, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = kernels.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_residual = ref_rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(new_residual, ref_residual, **tolerance(dtype))
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 80), (2, 3, 2 * 1100)])
def test_silu_and_mul_matches_reference(kernels, dtype, shape):
    x = torch.randn(shape).to(dtype)
    out = kernels.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, ref_silu_and_mul(x), **tolerance(dtype))


def _fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """q and k as views into one qkv projection output, as a model would pass them."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)  # [T, H * D], [T, KVH * D]
    return q, k


@pytest.mark.parametrize(
    "head_dim, rot_dim, num_heads, num_kv_heads, layout, dtype",
    [
        (64, 64, 4, 4, "flat", torch.float32),
        (128, 128, 8, 1, "flat", torch.float16),
        (80, 80, 6, 2, "heads", torch.float32),
        (64, 32, 3, 3, "heads", torch.float32),  # partial rotary: dims 32.. pass through
    ],
)
def test_rotary_embedding_matches_reference(
    kernels, head_dim, rot_dim, num_heads, num_kv_heads, layout, dtype
):
    positions = torch.tensor([0, 5, 1, 31, 7])
    q, k = _fused_qkv(5, num_heads, num_kv_heads, head_dim, dtype)
    if layout == "heads":
        q, k = q.view(5, num_heads, head_dim), k.view(5, num_kv_heads, head_dim)
    cache = cos_sin_cache(32, rot_dim).to(dtype)
    ref_q, ref_k = ref_rotary(positions, q, k, cache)
    assert kernels.rotary_embedding_(positions, q, k, cache) is None
    torch.testing.assert_close(q, ref_q, **tolerance(dtype))
    torch.testing.assert_close(k, ref_k, **tolerance(dtype))


@pytest.mark.parametrize(
    "block_size, num_kv_heads, head_dim, dtype",
    [(8, 2, 80, torch.float32), (16, 1, 64, torch.float16), (32, 3, 128, torch.float32)],
)
def test_reshape_and_cache_matches_reference(kernels, block_size, num_kv_heads, head_dim, dtype):
    num_tokens, num_blocks = 11, 6
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim).to(dtype)
    key, value = kv[:, 0], kv[:, 1]  # non-contiguous views, as from a fused projection
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_reshape_and_cache(key, value, ref_k, ref_v, slots)
    kernels.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_is_triton_available_under_interpreter(kernels):
    assert kernels.is_triton_available()

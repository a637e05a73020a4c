"""The plain-torch references against independent computations, so a wrong reference fails."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import alibi_slopes, cos_sin_cache, make_paged_batch

from llmserve.kernels.reference import (
    gather_kv,
    ref_paged_attention,
    ref_reshape_and_cache,
    ref_rms_norm,
    ref_rotary,
    ref_silu_and_mul,
)


def _sdpa_one_seq(q, k, v, scale, bias=None):
    """q: [q_len, H, D]; k, v: [seq_len, KVH, D] -> [q_len, H, D], via torch's SDPA with GQA."""
    q4, k4, v4 = (t.float().transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, len, D]
    is_causal = bias is None
    out = F.scaled_dot_product_attention(
        q4, k4, v4, attn_mask=bias, is_causal=is_causal, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)  # [q_len, H, D]


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(4, 4, 64, 16), (6, 2, 80, 8), (8, 1, 32, 32)],
)
def test_ref_attention_full_prefill_matches_sdpa(num_heads, num_kv_heads, head_dim, block_size):
    seq_lens = [1, 13, 40]
    batch = make_paged_batch(seq_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    out = ref_paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, scale,
    )  # fmt: skip
    starts = batch.query_start_loc.tolist()
    for b in range(len(seq_lens)):
        q = batch.q[starts[b] : starts[b + 1]]
        expected = _sdpa_one_seq(q, batch.keys[b], batch.values[b], scale)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], expected)


def test_ref_attention_chunk_is_tail_of_full_prefill():
    """A chunk over a cached prefix sees exactly what the same tokens see in a full prefill."""
    seq_len, q_len, num_heads, num_kv_heads, head_dim = 29, 7, 6, 3, 64
    full = make_paged_batch([seq_len], [seq_len], num_heads, num_kv_heads, head_dim, 8)
    scale = head_dim**-0.5
    expected = _sdpa_one_seq(full.q, full.keys[0], full.values[0], scale)[-q_len:]
    chunk_q = full.q[-q_len:]
    loc = torch.tensor([0, q_len], dtype=torch.int32)
    out = ref_paged_attention(
        chunk_q, full.k_cache, full.v_cache, loc, full.seq_lens, full.block_tables, scale
    )
    torch.testing.assert_close(out, expected)


def test_ref_attention_alibi_matches_sdpa_with_bias():
    q_lens, seq_lens, num_heads, num_kv_heads, head_dim = [3, 9], [11, 9], 4, 2, 32
    batch = make_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16)
    slopes, scale = alibi_slopes(num_heads), 0.3
    out = ref_paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, scale, alibi_slopes=slopes,
    )  # fmt: skip
    starts = batch.query_start_loc.tolist()
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        bias = torch.full((num_heads, q_len, seq_len), float("-inf"))
        for i in range(q_len):
            query_pos = seq_len - q_len + i
            for j in range(query_pos + 1):
                bias[:, i, j] = slopes * (j - query_pos)
        q = batch.q[starts[b] : starts[b + 1]]
        expected = _sdpa_one_seq(q, batch.keys[b], batch.values[b], scale, bias[None])
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], expected)


@pytest.mark.parametrize("with_residual", [False, True])
def test_ref_rms_norm_matches_torch(with_residual):
    x, residual, weight = torch.randn(5, 80), torch.randn(5, 80), torch.randn(80)
    if with_residual:
        out, new_residual = ref_rms_norm(x, weight, 1e-5, residual)
        torch.testing.assert_close(new_residual, x + residual)
        x = x + residual
    else:
        out = ref_rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (80,), weight, eps=1e-5))


def test_ref_silu_and_mul_matches_formula():
    x = torch.randn(2, 3, 2 * 40)
    gate, up = x[..., :40], x[..., 40:]
    torch.testing.assert_close(ref_silu_and_mul(x), gate / (1 + torch.exp(-gate)) * up)


def _rotate_complex(x, positions, rot_dim, is_neox, base=10000.0):
    """Rotary as complex multiplication: pair j of each head turns by pos * base^(-2j/rot_dim)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2).double() / rot_dim)
    turn = torch.polar(torch.ones(1).double(), positions.double()[:, None] * inv_freq)
    x_rot = x[..., :rot_dim].double()
    if is_neox:
        pairs = torch.complex(x_rot[..., : rot_dim // 2], x_rot[..., rot_dim // 2 :])
        rotated = pairs * turn[:, None, :]  # [T, H, rot_dim // 2]
        out = torch.cat([rotated.real, rotated.imag], dim=-1)
    else:
        pairs = torch.complex(x_rot[..., 0::2], x_rot[..., 1::2])
        rotated = pairs * turn[:, None, :]
        out = torch.stack([rotated.real, rotated.imag], dim=-1).flatten(-2)
    return torch.cat([out.float(), x[..., rot_dim:]], dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim, rot_dim", [(64, 64), (80, 32)])
def test_ref_rotary_matches_complex_rotation(is_neox, head_dim, rot_dim):
    positions = torch.tensor([0, 3, 17, 5])
    q, k = torch.randn(4, 6, head_dim), torch.randn(4, 2, head_dim)
    new_q, new_k = ref_rotary(positions, q, k, cos_sin_cache(32, rot_dim), is_neox)
    torch.testing.assert_close(new_q, _rotate_complex(q, positions, rot_dim, is_neox))
    torch.testing.assert_close(new_k, _rotate_complex(k, positions, rot_dim, is_neox))


def test_ref_rotary_flat_layout_matches_heads_layout():
    positions = torch.tensor([1, 2, 9])
    q, k, cache = torch.randn(3, 4, 64), torch.randn(3, 2, 64), cos_sin_cache(16, 64)
    flat_q, flat_k = ref_rotary(positions, q.flatten(1), k.flatten(1), cache)
    heads_q, heads_k = ref_rotary(positions, q, k, cache)
    torch.testing.assert_close(flat_q, heads_q.flatten(1))
    torch.testing.assert_close(flat_k, heads_k.flatten(1))


def test_ref_reshape_and_cache_round_trips_through_block_table():
    block_size, seq_len = 8, 13
    k_cache, v_cache = torch.zeros(4, block_size, 2, 16), torch.zeros(4, block_size, 2, 16)
    block_table = torch.tensor([3, 1], dtype=torch.int32)
    key, value = torch.randn(seq_len + 1, 2, 16), torch.randn(seq_len + 1, 2, 16)
    positions = torch.arange(seq_len)
    slots = block_table.long()[positions // block_size] * block_size + positions % block_size
    slots = torch.cat([slots, torch.tensor([-1])])  # a padding token, not written
    ref_reshape_and_cache(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(gather_kv(k_cache, block_table, seq_len), key[:seq_len])
    torch.testing.assert_close(gather_kv(v_cache, block_table, seq_len), value[:seq_len])
    assert k_cache[0].abs().sum() == 0 and k_cache[1, seq_len - block_size :].abs().sum() == 0


def test_kernels_package_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import llmserve.kernels as k\n"
        "assert not k.is_triton_available()\n"
        "from llmserve.kernels import ref_rms_norm\n"
        "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

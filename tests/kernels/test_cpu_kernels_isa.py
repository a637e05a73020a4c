"""The C++ CPU kernels on every instruction-set path this CPU runs (AVX-512, AVX2, plain C++),
in float32 and bfloat16, against plain torch in float32.

A bf16 kernel reads bf16, computes in fp32 and rounds once when it stores, so it is compared
with the fp32 reference on the same (bf16-representable) inputs within bf16 tolerance. The
paths are forced with ``forced_isa``; on an AVX2-only host the AVX-512 cases skip, and CI on
such a host still runs the AVX2 and scalar ones, and ``avx2_w16``: the AVX-512 code's 16-lane
shape (tiles, head groups, tails) on pairs of AVX2 vectors, so its logic is checked there too.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from kernel_testing import LAYOUTS, in_layout, make_paged_batch, step_kv, tolerance
from torch.nn import functional as F

from llmserve.cpuinfo import cpu_fields, cpu_flags
from llmserve.kernels import cpu as cpu_kernels
from llmserve.kernels.reference import ref_paged_attention
from llmserve.layers.position import Rope
from llmserve.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
DTYPES = [torch.float32, torch.bfloat16]


def fp32_reference(batch, scale: float) -> torch.Tensor:
    """The batch attended in fp32 by the plain-torch reference, ``[tokens, heads, dim]``."""
    caches = (batch.k_cache.float(), batch.v_cache.float())
    return ref_paged_attention(
        batch.q.float(), *caches, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )


# (head_dim, block_size, num_heads, num_kv_heads, seq_lens): the per-sequence path (many
# sequences) and the split-K path (a few long ones); head_dim 80 and 72 leave a tail of lanes
DECODE_CASES = {
    "hd64-bs16-gqa3": (64, 16, 9, 3, [1, 17, 70, 203]),
    "hd80-bs32-mha": (80, 32, 4, 4, [9, 130, 5]),
    "hd128-bs128-gqa8": (128, 128, 16, 2, [33, 64, 300]),
    "hd72-bs64-mqa-split": (72, 64, 8, 1, [1000]),
    "many-seqs-bs16": (64, 16, 6, 2, [(37 * i) % 300 + 1 for i in range(24)]),
    # blocks narrower than an AVX-512 vector; 50 query pairs, not a multiple of 4
    "hd100-bs8-gqa2": (100, 8, 4, 2, [3, 9, 40, 77]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_paged_decode_matches_fp32_reference(isa, case, dtype, layout):
    head_dim, block_size, num_heads, num_kv_heads, seq_lens = case
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(
        batch.q, in_layout(batch.k_cache, layout), batch.v_cache, batch.block_tables,
        batch.seq_lens, scale,
    )  # fmt: skip
    ref = fp32_reference(batch, scale)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **tolerance(dtype))


# (head_dim, block_size, num_heads, num_kv_heads, q_lens, seq_lens): prompt chunks with and
# without cached context before them, beside decodes; row counts off the items' (16 rows with
# 9 heads, 9 with 16)
VARLEN_CASES = {
    "mixed-gqa3": (64, 16, 9, 3, [1, 1, 37, 140, 5], [30, 200, 37, 164, 5]),
    "hd80-bs32-mha": (80, 32, 4, 4, [1, 70, 3], [9, 130, 3]),
    "hd72-bs64-mqa-long": (72, 64, 8, 1, [300], [1000]),
    "hd128-gqa8": (128, 16, 16, 2, [17, 1, 2], [33, 64, 2]),
    # items of 7, 2 and 15 rows (21, 6 and 45 heads a KV head: two-block score passes of
    # 8 + 8 + 5, 6 and 5 x 8 + 5 heads on AVX-512), cached context before the first chunk
    "rows7-rows2-gqa3": (64, 16, 9, 3, [39, 66, 47], [71, 66, 47]),
}
# the same with prompts' first chunks of one length (one SDPA call for them), of others, and
# of fewer rows than sdpa_min_rows = 30 (left to the kernel)
SDPA_CASES = {
    "mixed-gqa3": VARLEN_CASES["mixed-gqa3"],
    "same-lengths": (64, 16, 9, 3, [1, 48, 20, 48, 33, 7], [40, 48, 50, 48, 33, 7]),
}


def as_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: str):
    """``[T, width]`` each, contiguous, or (``fused``) column slices of one ``[T, q + k + v]``
    tensor, as a fused QKV projection leaves them: rows strided, columns unit."""
    if rows == "contiguous":
        return q, k, v
    qkv = torch.cat([q, k, v], dim=1)
    q_end, k_end = q.shape[1], q.shape[1] + k.shape[1]
    return qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]


@pytest.mark.parametrize("rows", ["contiguous", "fused"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_paged_attention_varlen_matches_fp32_reference(isa, case, dtype, layout, rows):
    """Any step in one call: the new K/V are written at their slots (NaN there before), then
    every query row attends causally over its sequence's context; q/k/v may be strided rows."""
    check_varlen_step(case, dtype, layout, rows, sdpa_min_rows=0)


@pytest.mark.parametrize("sdpa_min_rows", [1, 30])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", SDPA_CASES.values(), ids=SDPA_CASES.keys())
def test_prompt_first_chunks_by_sdpa(case, dtype, layout, sdpa_min_rows):
    """Prompts whose whole context is this step's chunk, from ``sdpa_min_rows`` rows, attended
    by torch's SDPA (prompts of one length in one call) beside the kernel's rows (decodes, a
    chunk after cached context, shorter prompts): the same K/V written, outputs within
    tolerance of the fp32 reference; q/k/v as slices of one fused QKV tensor."""
    check_varlen_step(case, dtype, layout, "fused", sdpa_min_rows)


def check_varlen_step(case, dtype, layout: str, rows: str, sdpa_min_rows: int) -> None:
    head_dim, block_size, num_heads, num_kv_heads, q_lens, seq_lens = case
    batch = make_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    k, v, slot_mapping, k_cache, v_cache = step_kv(batch, q_lens, seq_lens)
    k_cache = in_layout(k_cache, layout)
    scale = head_dim**-0.5
    tokens = batch.q.shape[0]
    q = batch.q.reshape(tokens, -1)
    out = cpu_kernels.paged_attention(
        *as_rows(q, k, v, rows), k_cache, v_cache, slot_mapping, batch.block_tables,
        batch.seq_lens, batch.query_start_loc, scale, sdpa_min_rows,
    )  # fmt: skip
    torch.testing.assert_close(k_cache, batch.k_cache, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, batch.v_cache, equal_nan=True, rtol=0, atol=0)
    ref = fp32_reference(batch, scale)
    assert out.dtype == dtype and out.shape == (tokens, num_heads * head_dim)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().view_as(ref), ref, **tolerance(dtype))


def test_paged_attention_rejects_bad_query_starts():
    batch = make_paged_batch([3, 1], [5, 9], 4, 2, 64, 8)
    q = batch.q.reshape(4, -1)
    k = torch.zeros(4, 2 * 64)
    slots = torch.arange(4)
    args = (q, k, k, batch.k_cache, batch.v_cache, slots, batch.block_tables, batch.seq_lens)
    with pytest.raises(RuntimeError, match="query_start must run 0..4"):
        cpu_kernels.paged_attention(*args, torch.tensor([0, 3, 5], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="sequence 0 has 3 query rows for a context of 2"):
        short = torch.tensor([2, 9], dtype=torch.int32)
        cpu_kernels.paged_attention(*args[:-1], short, batch.query_start_loc, 0.1)
    with pytest.raises(RuntimeError, match=r"int32 \[num_seqs \+ 1\]"):
        cpu_kernels.paged_attention(*args, batch.query_start_loc.long(), 0.1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_decode_attention_writes_strided_rows(dtype, layout):
    """A decode step in one call (decode_attention) on q/k/v sliced from one fused QKV tensor:
    the same K/V pools and outputs as writing them by hand and attending with
    paged_decode_attention on contiguous copies."""
    head_dim, block_size, num_heads, num_kv_heads, seq_lens = DECODE_CASES["many-seqs-bs16"]
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    tokens = len(seq_lens)
    last = batch.seq_lens.long() - 1
    slot_mapping = batch.block_tables[torch.arange(tokens), last // block_size] * block_size
    slot_mapping = (slot_mapping + last % block_size).long()  # [tokens]
    new_k = torch.stack([k[-1] for k in batch.keys]).reshape(tokens, -1)
    new_v = torch.stack([v[-1] for v in batch.values]).reshape(tokens, -1)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = float("nan")
    k_cache = in_layout(k_cache, layout)
    q, k, v = as_rows(batch.q.reshape(tokens, -1), new_k, new_v, "fused")
    assert not q.is_contiguous()
    args = (slot_mapping, batch.block_tables, batch.seq_lens, head_dim**-0.5)
    out = cpu_kernels.decode_attention(q, k, v, k_cache, v_cache, *args)
    torch.testing.assert_close(k_cache, batch.k_cache, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, batch.v_cache, equal_nan=True, rtol=0, atol=0)
    expected = cpu_kernels.paged_decode_attention(
        batch.q, k_cache, v_cache, batch.block_tables, batch.seq_lens, head_dim**-0.5
    )
    torch.testing.assert_close(out, expected.reshape(tokens, -1), rtol=0, atol=0)


@pytest.mark.parametrize("seq_lens", [[9], [5, 9, 14]], ids=["one-row", "three-rows"])
def test_paged_attention_takes_any_query_layout(seq_lens):
    """q with columns apart (a transposed [H * D, T]) or, for one row, any row stride: the
    same output as from a contiguous q."""
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, 4, 2, 64, 8)
    tokens = len(seq_lens)
    q = batch.q.reshape(tokens, -1)
    column_major = q.t().contiguous().t()  # [T, H * D], strides (1, T)
    assert column_major.stride(1) == tokens
    positions = batch.seq_lens.long() - 1
    slots = batch.block_tables[torch.arange(tokens), positions // 8].long() * 8 + positions % 8
    new_k = torch.stack([k[-1] for k in batch.keys]).reshape(tokens, -1)
    new_v = torch.stack([v[-1] for v in batch.values]).reshape(tokens, -1)
    tail = (slots, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.125)
    outs = [
        cpu_kernels.paged_attention(x, new_k, new_v, batch.k_cache, batch.v_cache, *tail)
        for x in (q, column_major)
    ]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0].view(tokens, 4, 64), fp32_reference(batch, 0.125))


def test_kv_write_rejects_bad_slots_and_dtypes():
    batch = make_paged_batch([1, 1], [5, 9], 4, 2, 64, 8)
    q, k = batch.q.reshape(2, -1), torch.zeros(2, 2 * 64)
    tail = (batch.block_tables, batch.seq_lens, 0.1)
    capacity = batch.k_cache.shape[0] * batch.k_cache.shape[1]
    with pytest.raises(RuntimeError, match=f"slot_mapping\\[1\\] = {capacity} is outside"):
        slots = torch.tensor([0, capacity])
        cpu_kernels.decode_attention(q, k, k, batch.k_cache, batch.v_cache, slots, *tail)
    with pytest.raises(RuntimeError, match="v must be \\[T, kvh \\* D\\] with contiguous rows"):
        slots = torch.tensor([0, 1])
        cpu_kernels.decode_attention(q, k, k.bfloat16(), batch.k_cache, batch.v_cache, slots, *tail)


def test_paged_decode_rejects_mixed_dtypes():
    """q and out share a dtype; the caches are q's, or narrower (bf16 under fp32, fp8), never
    wider (tests/kernels/test_kv_cache_dtype.py has the narrower ones)."""
    batch = make_paged_batch([1], [5], 4, 2, 64, 8, torch.float32)
    tail = (batch.block_tables, batch.seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="must be in q's dtype, bfloat16, float8_e4m3fn"):
        cpu_kernels.paged_decode_attention(batch.q.bfloat16(), batch.k_cache, batch.v_cache, *tail)
    with pytest.raises(RuntimeError, match="q and out both float32 or both bfloat16"):
        out = torch.empty_like(batch.q, dtype=torch.bfloat16)
        cpu_kernels.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, *tail, out)
    with pytest.raises(RuntimeError, match="k_cache and v_cache dtypes differ"):
        cpu_kernels.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache.bfloat16(), *tail)


def _bf16_exact(*shape: int, scale: float = 1.0) -> torch.Tensor:
    """Random values that bf16 represents exactly, as fp32 (the reference's input)."""
    return (torch.randn(*shape) * scale).bfloat16().float()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [576, 100, 7])  # vector body and tails of every width
def test_rms_norm_and_fused_residual(isa, dtype, width):
    x, residual, weight = (
        _bf16_exact(37, width, scale=3),
        _bf16_exact(37, width),
        _bf16_exact(width),
    )
    tol = tolerance(dtype)
    out = cpu_kernels.rms_norm(x.to(dtype), weight.to(dtype), 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), F.rms_norm(x, (width,), weight, 1e-5), **tol)
    x_in, res_in = x.to(dtype, copy=True), residual.to(dtype, copy=True)
    out, res_out = cpu_kernels.fused_add_rms_norm_(x_in, res_in, weight.to(dtype), 1e-5)
    assert out.data_ptr() == x_in.data_ptr() and res_out.data_ptr() == res_in.data_ptr()
    summed = (x.to(dtype) + residual.to(dtype)).float()  # the residual stream rounds to dtype
    torch.testing.assert_close(res_out.float(), summed, **tol)
    torch.testing.assert_close(out.float(), F.rms_norm(summed, (width,), weight, 1e-5), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_fp32_weight(isa, dtype):
    """Gemma's norm: the rows times ``1 + w`` kept in fp32 (not rounded to bf16 first)."""
    x, weight = _bf16_exact(9, 256, scale=3), 1 + torch.randn(256) * 0.1
    out = cpu_kernels.rms_norm(x.to(dtype), weight, 1e-6)
    assert out.dtype == dtype
    expected = F.rms_norm(x, (256,), weight, 1e-6)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 0}
    torch.testing.assert_close(out.float(), expected, **tol)  # bf16: one rounding at the store


GATED = {"silu": (cpu_kernels.silu_and_mul, F.silu), "gelu_tanh": (
    cpu_kernels.gelu_tanh_and_mul, lambda g: F.gelu(g, approximate="tanh"),
)}  # fmt: skip


@pytest.mark.parametrize("act", GATED.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [1536, 12, 5])
def test_act_and_mul(isa, dtype, width, act):
    kernel, reference = GATED[act]
    x = _bf16_exact(50, 2 * width, scale=6)
    x[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])  # exp's clamped range and zero
    out = kernel(x.to(dtype))
    assert out.shape == (50, width) and out.dtype == dtype
    x64 = x.double()  # torch's fp32 tanh-GELU loses precision near 0 (1 + tanh(u) cancels)
    expected = (reference(x64[:, :width]) * x64[:, width:]).float()
    tol = {"rtol": 2e-6, "atol": 1e-6} if dtype == torch.float32 else tolerance(dtype)
    torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rotary_interleaved(isa, dtype):
    head_dim, heads = 64, 12
    rope = RotaryEmbedding(
        head_dim, {"rope_theta": 10000.0, "rope_type": "default"}, 512, 512, kernels="torch"
    )
    qkv = _bf16_exact(20, (heads + 3) * head_dim)  # rotate the first 12 heads: a strided view
    qk = qkv[:, : heads * head_dim]
    positions = torch.randint(0, 512, (20,))
    expected = rope.forward_interleaved(positions, qk)  # fp32
    for cis in (rope.cis, rope.cis.to(dtype)):  # a bf16 model holds bf16 (cos, sin) pairs
        x = qkv.to(dtype)[:, : heads * head_dim]
        out = cpu_kernels.rotary_interleaved(x, positions, cis, head_dim)
        assert out.dtype == dtype
        tol = tolerance(torch.bfloat16 if torch.bfloat16 in (dtype, cis.dtype) else dtype)
        torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize("rotary_dim", [64, 40, 6])  # whole vectors, a tail, partial rotary
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rotary_neox_matches_torch(isa, dtype, rotary_dim):
    """NeoX's split halves against the plain-torch ``Rope`` on a strided view of fused q|k|v,
    with fp32 tables and with the bf16 tables a bf16 model holds; later channels copied."""
    head_dim, heads = 64, 5
    params = {"rope_theta": 10000.0, "rope_type": "default"}
    rope = Rope(head_dim, rotary_dim, params, 512, 512, is_neox=True, kernels="torch")
    qkv = _bf16_exact(20, (heads + 3) * head_dim)
    positions = torch.randint(0, 512, (20,))
    q = qkv[:, : heads * head_dim]
    k = qkv[:, heads * head_dim : (heads + 1) * head_dim]
    expected_q, expected_k = rope(positions, q, k)  # fp32
    for tables in ((rope.cos, rope.sin), (rope.cos.to(dtype), rope.sin.to(dtype))):
        x = qkv.to(dtype)[:, : heads * head_dim]
        out = cpu_kernels.rotary_neox(x, positions, *tables, head_dim, rotary_dim)
        assert out.dtype == dtype and out.shape == x.shape
        tol = tolerance(torch.bfloat16 if torch.bfloat16 in (dtype, tables[0].dtype) else dtype)
        torch.testing.assert_close(out.float(), expected_q, **tol)
        out_k = cpu_kernels.rotary_neox(k.to(dtype), positions, *tables, head_dim, rotary_dim)
        torch.testing.assert_close(out_k.float(), expected_k, **tol)
    with pytest.raises(RuntimeError, match="rotary_neox: position 600 outside 0..511"):
        cpu_kernels.rotary_neox(q, torch.full((20,), 600), rope.cos, rope.sin, head_dim, rotary_dim)
    with pytest.raises(RuntimeError, match="rotary_dim must be even"):
        cpu_kernels.rotary_neox(q, positions, rope.cos, rope.sin, head_dim, rotary_dim + 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [49152, 1000, 300, 256, 37, 1])  # whole blocks and tails
def test_argmax_rows_matches_torch_max(isa, dtype, width):
    x = torch.randn(23, width).to(dtype)
    x[1] = x[1].round()  # many ties: the first index wins
    x[2] = 0.0
    x[2, width // 2] = -0.0  # -0 and +0 are equal
    x[3, width - 1] = x[3].max() + 1  # the largest in the tail
    x[4] = -float("inf")  # all -inf
    x[5, width // 3] = float("inf")
    x[6, width - 1], x[6, width // 4] = float("nan"), 5.0  # a NaN is the largest
    x[7, width // 5 :] = float("nan")  # the first NaN wins
    x[8, (width * 2) // 3] = 1e30  # one value far above, inside a later block
    expected = x.max(dim=-1).indices
    assert cpu_kernels.argmax_rows(x).tolist() == expected.tolist()
    assert cpu_kernels.argmax_rows(x[:, :1]).tolist() == [0] * 23


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(RuntimeError, match=r"must be \[rows, n\] with n > 0"):
        cpu_kernels.argmax_rows(torch.randn(4, 0))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.argmax_rows(torch.randn(4, 8).half())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [5, 300, 1030])  # the tail only, blocks and a tail
def test_draw_rows_follows_softmax_at_each_temperature(isa, dtype, width):
    torch.manual_seed(1)
    row = torch.randn(width).to(dtype)
    row[width // 2 :: 2] = -float("inf")  # masked: never drawn
    row[1] += 3  # one likely token, so that frequencies are worth comparing
    num = 20000
    for temperature in (0.5, 1.0, 2.0):
        u = torch.rand(num)
        inv_t = torch.full((num,), 1.0 / temperature)
        drawn = cpu_kernels.draw_rows(row.expand(num, -1).contiguous(), inv_t, u)
        freqs = torch.bincount(drawn, minlength=width).float() / num
        expected = torch.softmax(row.float() / temperature, dim=-1)
        assert freqs[width // 2 :: 2].sum() == 0
        assert (freqs - expected).abs().max() < 0.015, temperature
        # the inverse CDF itself: u = 0 draws the first token, u just below 1 the last
        # unmasked one, and a u draws the first token whose cumulative probability passes it
        cdf = expected.double().cumsum(dim=-1)
        some_u = torch.tensor([0.0, 0.999999, 0.3, 0.7])
        ends = cpu_kernels.draw_rows(row.expand(4, -1).contiguous(), inv_t[:4], some_u)
        last = max(i for i in range(width) if row[i] > -float("inf"))
        middle = [int((cdf > x).nonzero()[0]) for x in (0.3, 0.7)]
        assert ends.tolist()[:2] == [0, last]
        assert all(abs(a - b) <= 1 for a, b in zip(ends.tolist()[2:], middle, strict=True))


def test_draw_rows_rows_without_a_finite_max_and_bad_input():
    x = torch.zeros(3, 40)
    x[0] = -float("inf")
    x[1, 7] = float("inf")
    x[2, 9] = float("nan")
    drawn = cpu_kernels.draw_rows(x, torch.ones(3), torch.full((3,), 0.5))
    assert drawn.tolist() == [0, 7, 9]  # their argmax
    with pytest.raises(RuntimeError, match="float32, one per row"):
        cpu_kernels.draw_rows(x, torch.ones(2), torch.full((3,), 0.5))


def test_bf16_rounds_to_nearest_even_and_keeps_nan(isa):
    """The vector stores round as torch does: ties to even, NaN stays NaN, overflow is inf."""
    up = (torch.randn(4, 64) * 10).bfloat16()
    up[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0078125, 3e38])
    gate = torch.full_like(up, 80.0)  # silu(80) == 80 in fp32: out = round(80 * up)
    out = cpu_kernels.silu_and_mul(torch.cat([gate, up], dim=1))
    expected = (up.float() * 80.0).bfloat16()
    torch.testing.assert_close(out, expected, equal_nan=True, atol=0, rtol=0)


def test_forcing_an_unknown_isa_raises():
    with pytest.raises(RuntimeError, match="isa must be one of auto, .*avx2_w16"):
        with cpu_kernels.forced_isa("avx9000"):
            pass


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU's flags from Linux")
def test_auto_takes_the_best_path_this_cpu_has_never_the_test_path():
    flags = cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "fma"} <= flags
    want = [
        *(["avx512_bf16"] if avx512 and "avx512_bf16" in flags else []),
        *(["avx512"] if avx512 else []),
        *(["avx2", "avx2_w16"] if {"avx2", "fma"} <= flags else []),
        "scalar",
    ]
    assert cpu_kernels.supported_isas() == want
    # on Intel without AMX, bf16 products run faster widened than by vdpbf16ps (isa.h)
    widen = cpu_fields().get("vendor_id") == "GenuineIntel" and "amx_bf16" not in flags
    best = "avx512" if want[0] == "avx512_bf16" and widen else want[0]
    with cpu_kernels.forced_isa("auto") as chosen:
        assert chosen == best
    assert cpu_kernels.widens_bf16() == (want[0] == "avx512_bf16" and widen)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="Linux only")
def test_kernels_read_the_amd_family_linux_lists():
    """attend_chunk picks its prefetch scheme by this family (Zen 5: 26): cpuid's reading
    must agree with /proc/cpuinfo's, and be 0 on other vendors."""
    fields = cpu_fields()
    expected = int(fields["cpu family"]) if fields.get("vendor_id") == "AuthenticAMD" else 0
    assert cpu_kernels.amd_family() == expected

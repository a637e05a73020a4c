"""The C++ attention kernels on a KV pool narrower than q (``--kv-cache-dtype``): fp8 e4m3fn
and e5m2 under fp32 and bf16 q, bf16 under fp32, on every instruction-set path this CPU runs.

The writes must store exactly torch's own rounding of ``x / scale`` (to nearest even,
saturated), every code must read back as torch's value of it, and the attention over the pool
must equal the fp32 reference over the dequantized pool."""

from __future__ import annotations

import shutil

import pytest
import torch
from kernel_testing import LAYOUTS, in_layout, make_paged_batch, step_kv, tolerance

from llmserve.kernels import cpu as cpu_kernels
from llmserve.kernels.reference import ref_paged_attention
from llmserve.layers import kv_quant

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# (q dtype, cache dtype): every pair the kernels take besides q's own dtype
PAIRS = [(q, kv) for q in (torch.float32, torch.bfloat16) for kv in FP8] + [
    (torch.float32, torch.bfloat16)
]
PAIR_IDS = ["fp32-e4m3", "fp32-e5m2", "bf16-e4m3", "bf16-e5m2", "fp32-bf16"]


def every_code(dtype: torch.dtype) -> torch.Tensor:
    """All finite values of an fp8 dtype, both signs, as fp32."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return values[values.isfinite()]


def tricky_values(dtype: torch.dtype) -> torch.Tensor:
    """Every code, the midpoints between neighbours (ties: round to even) and values just
    either side of them, past the largest finite value, in the subnormal range, inf, NaN."""
    codes = every_code(dtype).unique()  # sorted
    mids = (codes[1:] + codes[:-1]) / 2
    near = torch.cat([mids * (1 - 2**-20), mids * (1 + 2**-20)])
    limit = torch.finfo(dtype).max
    extra = torch.tensor([limit * 1.01, limit * 4, -limit * 8, 1e-12, -1e-12, 0.0, -0.0,
                          float("inf"), float("-inf")])  # fmt: skip
    return torch.cat([codes, mids, near, extra])


def write_rows(values: torch.Tensor, cache_dtype: torch.dtype, scale: float, layout: str):
    """``values`` written through decode_attention's K write into a fresh pool (one KV head
    of 64, block 16); returns the K pool's rows in slot order, ``[T, 64]`` uint8 bits."""
    width = 64
    rows = -(-values.numel() // width)
    x = torch.zeros(rows * width)
    x[: values.numel()] = values
    x = x.view(rows, width)
    blocks = -(-rows // 16)
    k_cache = torch.zeros(blocks, 16, 1, width, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache = in_layout(k_cache, layout)
    slots = torch.arange(rows)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    q = torch.zeros(1, width)
    cpu_kernels.decode_attention(  # the attention reads the rows too: it must not fail on them
        q, x[:1], x[:1], k_cache, v_cache, slots[:1], tables, torch.tensor([1], dtype=torch.int32),
        0.125, 0, scale, 1.0,
    )  # fmt: skip
    cpu_kernels.paged_attention(
        torch.zeros(rows, width), x, torch.zeros_like(x), k_cache, v_cache, slots, tables,
        torch.tensor([rows], dtype=torch.int32), torch.tensor([0, rows], dtype=torch.int32),
        0.125, 0, 0, scale, 1.0,
    )  # fmt: skip
    return (
        k_cache.reshape(-1, width)[:rows]
        if layout == "tokens"
        else torch.stack([k_cache[s // 16, s % 16, 0] for s in range(rows)])
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_write_rounds_as_torch(dtype, scale, layout):
    values = tricky_values(dtype) * scale
    got = write_rows(values, dtype, scale, layout).reshape(-1)[: values.numel()]
    want = kv_quant.quantize(values, dtype, scale)  # the torch paths' rounding
    finite = values.isfinite()
    assert torch.equal(got.view(torch.uint8)[finite], want.view(torch.uint8)[finite])
    # infinities saturate at the largest finite value (torch's conversion after the clamp)
    limit = torch.finfo(dtype).max
    assert torch.equal(got.float()[values == float("inf")], torch.tensor([limit]))
    assert torch.equal(got.float()[values == float("-inf")], torch.tensor([-limit]))
    # and the torch path's rounding is torch's own on values already in range
    in_range = finite & ((values / scale).abs() <= limit)
    direct = (values[in_range].float() * (1.0 / scale)).to(dtype)
    assert torch.equal(want[in_range].view(torch.uint8), direct.view(torch.uint8))


def test_bf16_pool_under_fp32_rounds_as_torch():
    values = torch.randn(4096) * 10.0 ** torch.randint(-30, 30, (4096,)).float()
    got = write_rows(values, torch.bfloat16, 1.0, "tokens").reshape(-1)[: values.numel()]
    assert torch.equal(got, values.bfloat16())


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_every_code_reads_back(isa, pair):
    """K and V pools holding every code of the dtype (bf16: a spread of exponents), under a
    query small enough to keep the scores mild: the output equals the fp32 reference over the
    pool's values, so a code widened wrong on this ISA path moves it."""
    q_dtype, kv_dtype = pair
    if kv_dtype in FP8:
        codes = every_code(kv_dtype)
    else:
        codes = (torch.randn(512) * 2.0 ** torch.randint(-20, 9, (512,)).float()).bfloat16().float()
    head_dim, block_size, tokens = 64, 16, 320
    batch = make_paged_batch([1, 1], [tokens, 37], 6, 2, head_dim, block_size)
    gen = torch.Generator().manual_seed(1)
    for cache in (batch.k_cache, batch.v_cache):
        picks = torch.randint(0, codes.numel(), cache.shape, generator=gen)
        cache.copy_(codes[picks])
    k_cache, v_cache = batch.k_cache.to(kv_dtype), batch.v_cache.to(kv_dtype)
    assert torch.equal(k_cache.float(), batch.k_cache)  # the codes are exact in the pool
    q = (batch.q * 2e-3).to(q_dtype)
    k_scale, v_scale = 0.5, 3.0
    out = cpu_kernels.paged_decode_attention(
        q, k_cache, v_cache, batch.block_tables, batch.seq_lens, 0.125, None, 0, k_scale, v_scale
    )
    ref = ref_paged_attention(
        q.float(), batch.k_cache * k_scale, batch.v_cache * v_scale, batch.query_start_loc,
        batch.seq_lens, batch.block_tables, 0.125,
    )  # fmt: skip
    assert out.dtype == q_dtype
    scale = ref.abs().max().item()  # outputs reach hundreds (V codes up to 448 x 3)
    tol = tolerance(q_dtype)
    torch.testing.assert_close(out.float() / scale, ref / scale, **tol)


# (head_dim, block_size, num_heads, num_kv_heads, q_lens, seq_lens): decodes only (split-K for
# the long one) and a mixed step of prompt chunks and decodes
CASES = {
    "decodes-gqa3": (64, 16, 9, 3, [1, 1, 1, 1], [1, 17, 70, 203]),
    "split-mqa": (72, 64, 8, 1, [1], [700]),
    "mixed-gqa3": (64, 16, 9, 3, [1, 37, 140, 5], [200, 37, 164, 5]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_attention_over_a_narrow_pool(isa, case, pair, layout):
    """A step in one call (the new K/V written into the pool, then every row attending): the
    output equals the fp32 reference over the pool's contents after the step, read back times
    the scales, and the pool holds the step's rows as torch rounds them."""
    head_dim, block_size, num_heads, kv_heads, q_lens, seq_lens = case
    q_dtype, kv_dtype = pair
    batch = make_paged_batch(q_lens, seq_lens, num_heads, kv_heads, head_dim, block_size)
    k_scale, v_scale = 0.25, 1.5
    new_k, new_v, slots, k_cache, v_cache = step_kv(batch, q_lens, seq_lens)
    # the context before the step, as the pool holds it (NaN slots stay NaN: never read)
    k_pool = kv_quant.quantize(k_cache * 4, kv_dtype, k_scale)  # keys up to ~20 (x 4)
    v_pool = kv_quant.quantize(v_cache, kv_dtype, v_scale)
    q = batch.q.to(q_dtype)
    new_k, new_v = (new_k * 4).to(q_dtype), new_v.to(q_dtype)
    tail = (batch.block_tables, batch.seq_lens)
    k_pool = in_layout(k_pool, layout)
    if all(n == 1 for n in q_lens):
        out = cpu_kernels.decode_attention(
            q.reshape(len(q_lens), -1), new_k, new_v, k_pool, v_pool, slots, *tail, 0.125, 0,
            k_scale, v_scale,
        )  # fmt: skip
    else:
        out = cpu_kernels.paged_attention(
            q.reshape(q.shape[0], -1), new_k, new_v, k_pool, v_pool, slots, *tail,
            batch.query_start_loc, 0.125, 0, 0, k_scale, v_scale,
        )  # fmt: skip
    written = torch.stack([k_pool[s // block_size, s % block_size] for s in slots.tolist()])
    want = kv_quant.quantize(new_k.float().view(-1, kv_heads, head_dim), kv_dtype, k_scale)
    assert torch.equal(written.float(), want.float())
    ref = ref_paged_attention(
        q.float(), k_pool.float() * k_scale, v_pool.float() * v_scale, batch.query_start_loc,
        batch.seq_lens, batch.block_tables, 0.125,
    )  # fmt: skip
    assert out.dtype == q_dtype and not out.isnan().any()
    torch.testing.assert_close(out.float().view_as(ref), ref, **tolerance(q_dtype))


def test_scales_apply_to_narrower_pools_only():
    """A pool in q's dtype is written and read as it is, whatever the scales (as
    layers/kv_quant.py does): the same output and pool with k_scale 2 as with 1."""
    batch = make_paged_batch([1, 1], [5, 40], 4, 2, 64, 8)
    new_k, new_v, slots, k_cache, v_cache = step_kv(batch, [1, 1], [5, 40])
    outs, pools = [], []
    for scales in ((1.0, 1.0), (2.0, 0.5)):
        k_pool, v_pool = k_cache.clone(), v_cache.clone()
        outs.append(
            cpu_kernels.decode_attention(
                batch.q.reshape(2, -1),
                new_k,
                new_v,
                k_pool,
                v_pool,
                slots,
                batch.block_tables,
                batch.seq_lens,
                0.125,
                0,
                *scales,
            )  # fmt: skip
        )
        pools.append(k_pool)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(pools[1], pools[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(kv_quant.quantize(new_k, torch.float32, 2.0), new_k)


def test_narrow_pool_errors():
    batch = make_paged_batch([1], [5], 4, 2, 64, 8)
    k = batch.k_cache.to(torch.float8_e4m3fn)
    tail = (batch.block_tables, batch.seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="k_scale and v_scale must be positive"):
        cpu_kernels.paged_decode_attention(batch.q, k, k, *tail, None, 0, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="must be in q's dtype, bfloat16, float8_e4m3fn or"):
        as_int = batch.k_cache.to(torch.int8)
        cpu_kernels.paged_decode_attention(batch.q, as_int, as_int, *tail)
    with pytest.raises(RuntimeError, match="k must be \\[T, kvh \\* D\\] with contiguous rows"):
        rows = torch.zeros(1, 2 * 64, dtype=torch.bfloat16)  # bf16 rows into an fp32 pool
        cpu_kernels.decode_attention(
            batch.q.reshape(1, -1), rows, rows, batch.k_cache, batch.v_cache, torch.tensor([0]),
            *tail,
        )  # fmt: skip

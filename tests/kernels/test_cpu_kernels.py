"""The C++ CPU kernels (llmserve/kernels/cpu) against plain torch.

They are built on first use; on a machine with a C++ compiler a failed build is a failure
here, not a skip (the engine would silently fall back to the slower torch path).
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from kernel_testing import make_paged_batch, mapping_field, mapping_flags, tolerance
from torch.nn import functional as F

from llmserve.kernels import cpu as cpu_kernels
from llmserve.kernels.reference import ref_paged_attention
from llmserve.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu_kernels.available(), "the C++ CPU kernels failed to build (see the log)"


# (head_dim, block_size, num_heads, num_kv_heads, seq_lens): lengths off block boundaries;
# a few long sequences take the split-K path (fewer sequences than 4 x threads), many short
# ones the one-item-per-sequence path.
DECODE_CASES = {
    "hd64-bs16-gqa3": (64, 16, 9, 3, [1, 17, 70, 203]),
    "hd80-bs8-gqa1": (80, 8, 4, 4, [9, 130, 5]),
    "hd128-bs32-gqa8": (128, 32, 16, 2, [33, 64, 300]),
    "hd64-bs16-mqa-split": (64, 16, 8, 1, [1000]),
    "many-seqs": (64, 8, 6, 2, [(7 * i) % 61 + 1 for i in range(40)]),
}


@pytest.mark.parametrize("threads", [1, 2, 3])  # 3: more threads than the CI host's cores
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_paged_decode_matches_reference(case, threads):
    head_dim, block_size, num_heads, num_kv_heads, seq_lens = case
    # Unowned pool slots are NaN: the kernel must read only each sequence's own positions.
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size
    )
    scale = head_dim**-0.5
    args = (batch.q, batch.k_cache, batch.v_cache)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.paged_decode_attention(*args, batch.block_tables, batch.seq_lens, scale)
    finally:
        torch.set_num_threads(old)
    ref = ref_paged_attention(
        *args, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_paged_decode_rejects_bad_input():
    batch = make_paged_batch([1, 1], [5, 20], 4, 2, 64, 8)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables)
    too_long = torch.tensor([5, 999], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = 999 is outside 1..24"):
        cpu_kernels.paged_decode_attention(*args, too_long, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.paged_decode_attention(
            batch.q.half(), batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.1
        )


@pytest.mark.parametrize("width", [576, 100, 7])  # 8-lane body, and the scalar tail
def test_rms_norm_and_fused_residual(width):
    x = torch.randn(37, width) * 3
    residual = torch.randn(37, width)
    weight = torch.randn(width)
    expected = F.rms_norm(x, (width,), weight, 1e-5)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, 1e-5), expected)
    summed = x + residual
    x_in, res_in = x.clone(), residual.clone()
    out, res_out = cpu_kernels.fused_add_rms_norm_(x_in, res_in, weight, 1e-5)
    assert out.data_ptr() == x_in.data_ptr() and res_out.data_ptr() == res_in.data_ptr()
    torch.testing.assert_close(res_out, summed)
    torch.testing.assert_close(out, F.rms_norm(summed, (width,), weight, 1e-5))


def test_prompts_go_to_sdpa_in_bf16_on_amx_only():
    """paged_attention's default: bf16 prompts of PROMPT_SDPA_MIN_ROWS rows or more to torch's
    SDPA where the CPU has AMX tiles, never in fp32 (the kernel is as fast there)."""
    amx = torch.cpu._is_amx_tile_supported()
    assert cpu_kernels.prompt_sdpa_min_rows(torch.float32) == 0
    assert cpu_kernels.PROMPT_SDPA_MIN_ROWS > 0
    expected = cpu_kernels.PROMPT_SDPA_MIN_ROWS if amx else 0
    assert cpu_kernels.prompt_sdpa_min_rows(torch.bfloat16) == expected


@pytest.mark.parametrize("width", [1536, 12])
def test_silu_and_mul(width):
    x = torch.randn(50, 2 * width) * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])  # exp's clamped range and zero
    out = cpu_kernels.silu_and_mul(x)
    expected = F.silu(x[:, :width]) * x[:, width:]
    assert out.shape == (50, width)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_rotary_interleaved_matches_torch_path():
    head_dim, heads = 64, 12
    torch_rope = RotaryEmbedding(
        head_dim, {"rope_theta": 10000.0, "rope_type": "default"}, 512, 512, kernels="torch"
    )
    qkv = torch.randn(20, (heads + 3) * head_dim)  # rotate the first 12 heads: a strided view
    qk = qkv[:, : heads * head_dim]
    positions = torch.randint(0, 512, (20,))
    out = cpu_kernels.rotary_interleaved(qk, positions, torch_rope.cis, head_dim)
    torch.testing.assert_close(out, torch_rope.forward_interleaved(positions, qk))
    with pytest.raises(RuntimeError, match="position 600 outside 0..511"):
        cpu_kernels.rotary_interleaved(qk, torch.full((20,), 600), torch_rope.cis, head_dim)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
@pytest.mark.parametrize("populate", ["madvise", "touch"])
def test_pools_are_faulted_in_at_allocation(monkeypatch, populate):
    """Every page of a pool is resident as soon as it is allocated (its Rss covers it), by
    MADV_POPULATE_WRITE or, where the kernel refuses that, a write to each page; still zeros."""
    from llmserve import memory
    from llmserve.runner import kv_cache

    if populate == "touch":  # an advice the kernel refuses, as kernels before 5.14 do
        monkeypatch.setattr(memory, "MADV_POPULATE_WRITE", -1)
    spec = kv_cache.KVCacheSpec(
        num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_size=16
    )
    blocks = 4 * kv_cache.HUGE_PAGE // (16 * 2 * 64 * 4)  # 8 MiB per pool
    ((k, v),) = kv_cache.allocate(spec, blocks, torch.device("cpu"), "cpp")
    for pool in (k, v):
        rss_kib = int(mapping_field(pool.data_ptr(), "Rss:")[0])
        assert rss_kib * 1024 >= pool.numel() * pool.element_size()
        assert not pool.any()


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's"
)
def test_pools_past_a_huge_page_ask_for_huge_pages():
    """A pool of 2 MiB or more sits 2 MiB-aligned in a mapping marked MADV_HUGEPAGE ("hg" in
    its VmFlags), starts as zeros, and the Python writer and the C++ decode step use it as
    they use a plain tensor; smaller pools stay plain tensors."""
    from llmserve.layers.attention import write_kv
    from llmserve.runner.kv_cache import HUGE_PAGE, KVCacheSpec, allocate

    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_size=16
    )
    blocks = HUGE_PAGE // (16 * 2 * 64 * 4) + 3  # just past 2 MiB per pool
    cpu = torch.device("cpu")
    for backend in (None, "cpp"):
        pools = allocate(spec, blocks, cpu, backend)
        for pool in (t for pair in pools for t in pair):
            assert pool.shape == (blocks, 16, 2, 64) and pool.dtype == torch.float32
            assert pool.data_ptr() % HUGE_PAGE == 0 and "hg" in mapping_flags(pool.data_ptr())
            assert not pool.any()
        ((k, v), _) = pools
        plain = [t.clone() for t in (k, v)]
        slots = torch.tensor([0, 17, 18, 16 * blocks - 1])
        new_k, new_v = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
        write_kv(new_k, new_v, k, v, slots)
        write_kv(new_k, new_v, *plain, slots)
        assert torch.equal(k, plain[0]) and torch.equal(v, plain[1])
        assert torch.equal(k[blocks - 1, 15], new_k[3])
        q = torch.randn(1, 4 * 64)
        tables = torch.tensor([[1, 0]], dtype=torch.int32)
        lens = torch.tensor([19], dtype=torch.int32)
        step = torch.tensor([2])  # position 18: block 0 (the table's second), offset 2
        k_step, v_step = torch.randn(1, 2 * 64), torch.randn(1, 2 * 64)
        outs = [
            cpu_kernels.decode_attention(q, k_step, v_step, kc, vc, step, tables, lens, 0.125)
            for kc, vc in ((k, v), plain)
        ]
        torch.testing.assert_close(outs[0], outs[1])
        assert torch.equal(k, plain[0]) and torch.equal(k[0, 2], k_step.view(2, 64))
    ((small, _),) = allocate(KVCacheSpec(1, 2, 8, torch.float32, 4), 6, cpu)
    assert "hg" not in mapping_flags(small.data_ptr())


def test_transposed_key_pool_reads_and_writes_like_the_plain_one():
    """The cpp backend's K pool (each block stored [kv_heads, head_dim, block_size] behind a
    [blocks, block_size, kv_heads, head_dim] view): the Python writer, copy-on-write and the
    C++ decode step see the same values as with the plain pool."""
    from llmserve.layers.attention import write_kv
    from llmserve.runner.kv_cache import KVCacheSpec, allocate, copy_blocks

    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
    ((k_plain, v_plain),) = allocate(spec, 6, torch.device("cpu"))
    ((k_t, v_t),) = allocate(spec, 6, torch.device("cpu"), backend="cpp")
    assert k_plain.is_contiguous() and not k_t.is_contiguous() and k_t.shape == k_plain.shape
    assert k_t.permute(0, 2, 3, 1).is_contiguous()  # the stored layout
    slots = torch.tensor([0, 5, 6, 7, 13])
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    write_kv(k, v, k_plain, v_plain, slots)
    write_kv(k, v, k_t, v_t, slots)
    assert torch.equal(k_t, k_plain) and torch.equal(k_t[1, 1], k[1])
    copy_blocks([(k_plain, v_plain), (k_t, v_t)], [(1, 4), (3, 5)])
    assert torch.equal(k_t, k_plain) and torch.equal(k_t[4, 2], k[2])
    # the C++ decode step writes this step's K into the transposed pool, then attends
    q, k_new, v_new = torch.randn(2, 4 * 8), torch.randn(2, 2 * 8), torch.randn(2, 2 * 8)
    tables = torch.tensor([[0, 1], [4, 5]], dtype=torch.int32)
    lens = torch.tensor([7, 6], dtype=torch.int32)
    step = torch.tensor([6, 5 * 4 + 1])  # position 6 of sequence 0, 5 of sequence 1
    outs = [
        cpu_kernels.decode_attention(q, k_new, v_new, kc, vc, step, tables, lens, 8**-0.5)
        for kc, vc in ((k_plain, v_plain), (k_t, v_t))
    ]
    assert torch.equal(k_t, k_plain) and torch.equal(k_t[1, 2], k_new[0].view(2, 8))
    torch.testing.assert_close(outs[1], outs[0])

"""Triton split-K paged_decode_attention against ref_paged_attention, under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import alibi_slopes, make_paged_batch, tolerance

from llmserve.kernels.reference import ref_paged_attention

# (head_dim, block_size, num_heads, num_kv_heads, seq_lens, use_alibi, num_splits)
CASES = {
    "mha-auto": (64, 16, 4, 4, [1, 17, 70], False, None),
    "gqa3-alibi-3splits": (80, 8, 6, 2, [9, 130, 5], True, 3),
    "gqa8-1split": (128, 32, 16, 2, [33, 64], False, 1),
    "mqa-alibi-empty-splits": (64, 8, 8, 1, [1, 2, 200], True, 5),
    "hd80-gqa1-auto": (80, 16, 3, 3, [47], False, None),
}


def _run(kernels, case, dtype, seed=0, tile=None):
    head_dim, block_size, num_heads, num_kv_heads, seq_lens, use_alibi, num_splits = case
    q_lens = [1] * len(seq_lens)
    batch = make_paged_batch(
        q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed
    )
    slopes = alibi_slopes(num_heads) if use_alibi else None
    scale = head_dim**-0.5
    caches = (batch.k_cache, batch.v_cache)
    out = kernels.paged_decode_attention(
        batch.q, *caches, batch.seq_lens, batch.block_tables, scale, slopes, num_splits, tile
    )
    ref = ref_paged_attention(
        batch.q, *caches, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale, slopes
    )
    return out, ref


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_paged_decode_matches_reference_fp32(kernels, case):
    out, ref = _run(kernels, case, torch.float32)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("name", ["gqa3-alibi-3splits", "gqa8-1split"])
def test_paged_decode_matches_reference_fp16(kernels, name):
    out, ref = _run(kernels, CASES[name], torch.float16, seed=1)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref, **tolerance(torch.float16))


@pytest.mark.parametrize("tile", [(1, 16, 4, 3), (1, 128, 8, 2)], ids=["bn16", "bn128"])
def test_paged_decode_other_tiles(kernels, tile):
    """Key tiles shorter and longer than a split's chunk, with ALiBi and empty splits."""
    from llmserve.kernels.flash_attention import TileConfig

    out, ref = _run(kernels, CASES["mqa-alibi-empty-splits"], torch.float32, tile=TileConfig(*tile))
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_paged_decode_agrees_with_flash_prefill(kernels):
    """A batch of one-token queries gives the same answer through either kernel."""
    batch = make_paged_batch([1, 1, 1], [3, 40, 19], 6, 3, 64, 16)
    args = (batch.q, batch.k_cache, batch.v_cache)
    decode = kernels.paged_decode_attention(*args, batch.seq_lens, batch.block_tables, 0.125)
    prefill = kernels.flash_attn_varlen_paged(
        *args, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.125, 1
    )
    torch.testing.assert_close(decode, prefill, **tolerance(torch.float32))


def test_paged_decode_padding_row_is_zero(kernels):
    """A padding sequence with seq_len 0 yields zeros, not NaN, and leaves the others alone."""
    batch = make_paged_batch([1, 1], [12, 1], 4, 2, 64, 8)
    seq_lens = torch.tensor([12, 0], dtype=torch.int32)
    args = (batch.q, batch.k_cache, batch.v_cache)
    out = kernels.paged_decode_attention(*args, seq_lens, batch.block_tables, 0.125, num_splits=2)
    ref = ref_paged_attention(
        *args, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.125
    )
    torch.testing.assert_close(out[0], ref[0], **tolerance(torch.float32))
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_default_num_splits_stays_in_range():
    pytest.importorskip("triton")
    from llmserve.kernels.paged_decode import default_num_splits

    cpu = torch.device("cpu")
    assert default_num_splits(1, 1, cpu) > 1
    assert default_num_splits(1024, 8, cpu) == 1
    assert all(1 <= default_num_splits(n, 2, cpu) <= 16 for n in range(1, 40))


def test_paged_decode_rejects_bad_num_splits(kernels):
    batch = make_paged_batch([1], [5], 2, 1, 64, 8)
    with pytest.raises(ValueError, match="num_splits"):
        kernels.paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, 1.0,
            num_splits=0,
        )  # fmt: skip

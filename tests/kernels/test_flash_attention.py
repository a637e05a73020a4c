"""Triton flash_attn_varlen_paged against ref_paged_attention, under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import alibi_slopes, make_paged_batch, tolerance

from llmserve.kernels.reference import ref_paged_attention

# (head_dim, block_size, num_heads, num_kv_heads, q_lens, seq_lens, use_alibi)
CASES = {
    "full-prefill": (64, 16, 4, 4, [37], [37], False),
    "mixed-gqa3-alibi": (80, 8, 6, 2, [1, 5, 20], [9, 5, 37], True),
    "prefix-mqa": (128, 32, 8, 1, [70, 3], [100, 3], False),
    "chunks-gqa8-alibi": (64, 32, 16, 2, [1, 16, 33], [1, 50, 33], True),
    "hd80-gqa1": (80, 16, 3, 3, [66], [81], False),
    "hd256-smaller-tiles": (256, 16, 2, 1, [40], [45], True),
}


def _run(kernels, case, dtype, seed=0, tile=None):
    head_dim, block_size, num_heads, num_kv_heads, q_lens, seq_lens, use_alibi = case
    batch = make_paged_batch(
        q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed
    )
    slopes = alibi_slopes(num_heads) if use_alibi else None
    args = (
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, head_dim**-0.5,
    )  # fmt: skip
    out = kernels.flash_attn_varlen_paged(
        *args, batch.max_query_len, alibi_slopes=slopes, tile=tile
    )
    return out, ref_paged_attention(*args, alibi_slopes=slopes)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_flash_attention_matches_reference_fp32(kernels, case):
    out, ref = _run(kernels, case, torch.float32)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("name", ["mixed-gqa3-alibi", "prefix-mqa"])
def test_flash_attention_matches_reference_fp16(kernels, name):
    out, ref = _run(kernels, CASES[name], torch.float16, seed=1)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref, **tolerance(torch.float16))


def test_flash_attention_reads_q_through_strides(kernels):
    """q as a view into a fused qkv projection (token stride larger than heads * head_dim)."""
    batch = make_paged_batch([4, 6], [10, 6], 4, 2, 64, 16)
    qkv = torch.randn(10, (4 + 2 * 2) * 64)
    q = qkv[:, : 4 * 64].view(10, 4, 64)  # [num_tokens, num_heads, head_dim], non-contiguous
    args = (q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens)
    out = kernels.flash_attn_varlen_paged(*args, batch.block_tables, 0.125, 6)
    ref = ref_paged_attention(*args, batch.block_tables, 0.125)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


# Tiles other than the default: query blocks taller and shorter than the key tiles, so the
# unmasked tiles before the diagonal and the masked ones on it meet at every offset.
# (block_m, block_n, num_warps, num_stages)
TILES = [(16, 16, 4, 3), (32, 16, 4, 3), (16, 32, 8, 2)]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_flash_attention_other_tiles(kernels, tile):
    from llmserve.kernels.flash_attention import TileConfig

    tile = TileConfig(*tile)
    # prefix + chunk, a chunk whose first query is not tile-aligned, a full prefill, alibi
    case = (64, 16, 4, 2, [70, 23, 41], [100, 60, 41], True)
    out, ref = _run(kernels, case, torch.float32, seed=2, tile=tile)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))

"""The C++ CPU attention kernels with a sliding window (Mistral's and Gemma's local layers), on
every instruction-set path this CPU runs, in float32 and bfloat16, against the plain-torch
reference in float32 (the query at position p sees keys p - window + 1 .. p only).

The cases put a window's first token inside a block and on a block's edge, windows shorter
than a block, than a prompt item's rows (whose first online-softmax step then holds no key
of some rows) and longer than every context (nothing masked), on the per-sequence, split-K
and prompt-row paths.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from kernel_testing import LAYOUTS, in_layout, make_paged_batch, step_kv, tolerance

from llmserve.kernels import cpu as cpu_kernels
from llmserve.kernels.reference import ref_paged_attention

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
DTYPES = [torch.float32, torch.bfloat16]


def windowed_reference(batch, scale: float, window: int | None) -> torch.Tensor:
    caches = (batch.k_cache.float(), batch.v_cache.float())
    return ref_paged_attention(
        batch.q.float(), *caches, batch.query_start_loc, batch.seq_lens, batch.block_tables,
        scale, sliding_window=window,
    )  # fmt: skip


# (head_dim, block_size, num_heads, num_kv_heads, seq_lens, window): many sequences (one item
# each), a few long ones (split-K: chunks counted from the window's first block)
DECODE_CASES = {
    "many-seqs-bs16": (64, 16, 6, 2, [(37 * i) % 300 + 1 for i in range(24)], 40),
    "block-edge-bs16": (64, 16, 9, 3, [48, 49, 200, 17], 32),
    "split-bs16-w100": (64, 16, 4, 1, [1000, 700], 100),
    "split-bs128-w20": (72, 128, 8, 2, [900], 20),
    "window-past-every-context": (64, 16, 4, 2, [30, 70], 512),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_windowed_decode_matches_reference(isa, case, dtype, layout):
    head_dim, block_size, num_heads, num_kv_heads, seq_lens, window = case
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(
        batch.q, in_layout(batch.k_cache, layout), batch.v_cache, batch.block_tables,
        batch.seq_lens, scale, window=window,
    )  # fmt: skip
    ref = windowed_reference(batch, scale, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **tolerance(dtype))
    if window < max(seq_lens):  # the window changed the answer: the test can tell
        assert (windowed_reference(batch, scale, None) - ref).abs().max() > 1e-2


# (head_dim, block_size, num_heads, num_kv_heads, q_lens, seq_lens, window): whole prompts past
# the window, chunks after cached context, decodes beside them
VARLEN_CASES = {
    "mixed-gqa3-w24": (64, 16, 9, 3, [1, 1, 37, 140, 5], [30, 200, 37, 164, 5], 24),
    "long-prompt-w100": (64, 16, 9, 3, [300], [300], 100),
    # a window shorter than a 16-row item and than a block of 128: the item's first step holds
    # no visible key for its later rows
    "bs128-w5": (64, 128, 9, 3, [300, 1], [300, 140], 5),
    "mha-bs32-w33": (80, 32, 4, 4, [1, 70, 3], [9, 130, 3], 33),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_windowed_prompt_rows_match_reference(isa, case, dtype, layout):
    """Any step in one call with a window: the new K/V written at their slots, every row
    attending over its window of its sequence's context (SDPA asked for from one row: a
    prompt longer than the window stays with the kernel)."""
    head_dim, block_size, num_heads, num_kv_heads, q_lens, seq_lens, window = case
    batch = make_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    k, v, slot_mapping, k_cache, v_cache = step_kv(batch, q_lens, seq_lens)
    tokens = batch.q.shape[0]
    scale = head_dim**-0.5
    out = cpu_kernels.paged_attention(
        batch.q.reshape(tokens, -1), k, v, in_layout(k_cache, layout), v_cache, slot_mapping, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, scale, 1, window,
    )  # fmt: skip
    torch.testing.assert_close(v_cache, batch.v_cache, equal_nan=True, rtol=0, atol=0)
    ref = windowed_reference(batch, scale, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().view_as(ref), ref, **tolerance(dtype))


def test_negative_window_is_rejected():
    batch = make_paged_batch([1], [5], 4, 2, 64, 8)
    with pytest.raises(RuntimeError, match="window must be 0 .none. or a sliding window"):
        cpu_kernels.paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.1,
            window=-1,
        )  # fmt: skip

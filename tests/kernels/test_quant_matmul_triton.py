"""Triton quant_matmul (W4A16 / W8A16) against layout.reference_linear, under TRITON_INTERPRET=1.

Weights are drawn so outputs are O(1) (scale ~ 1 / (range * sqrt(K))), and tolerances are
relative to the largest reference output:
    fp32 x: 1e-4  (the kernel and the reference both accumulate exact fp32 products)
    fp16 x: 1e-2, bf16 x: 2e-2  (the kernel rounds W to x's dtype before the dot, the
            reference does not; plus the rounding of the output itself)
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from llmserve.quantization.layout import QuantizedWeight, pack_int4, reference_linear

K = 128
N = 40  # not a multiple of the interpreter's BLOCK_N (32): a masked N tile

# name: (bits, in_features, group_size, has_mins, has_lut, has_perm)
CASES = {
    "w8-g16": (8, K, 16, False, False, False),
    "w8-g32-mins": (8, K, 32, True, False, False),
    "w8-gK-perm": (8, K, K, False, False, True),
    "w4-g32-mins": (4, K, 32, True, False, False),
    "w4-g64": (4, K, 64, False, False, False),
    "w4-gK-lut": (4, K, K, False, True, False),
    "w4-g64-lut-perm": (4, K, 64, False, True, True),
    "w4-g32-mins-perm": (4, K, 32, True, False, True),
    "w4-k96-g32-mins": (4, 96, 32, True, False, False),  # K tile falls back to 32
    "w8-k96-gK-mins-perm": (8, 96, 96, True, False, True),
}
NF4_LIKE_LUT = [-127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 32, 43, 56, 71, 92, 127]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.fixture
def quant_matmul(kernels):
    """The kernel entry point (skipped without Triton through the `kernels` fixture)."""
    return importlib.import_module("llmserve.kernels.quant_matmul").quant_matmul


def make_weight(bits, k, group_size, has_mins, has_lut, has_perm, n=N) -> QuantizedWeight:
    """A random weight in the internal layout whose products with randn x are O(1)."""
    num_groups = k // group_size
    if bits == 8:
        qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        value_range = 128.0
    else:
        qweight = pack_int4(torch.randint(0, 16, (n, k)))  # [N, K // 2] uint8
        value_range = 127.0 if has_lut else 8.0
    scales = (0.5 + torch.rand(n, num_groups)) / (value_range * k**0.5)  # [N, K / G]
    mins = None
    if has_mins:
        center = -8.0 if bits == 4 and not has_lut else 0.0
        mins = scales * (center + torch.randn(n, num_groups))
    lut = torch.tensor(NF4_LIKE_LUT, dtype=torch.int8) if has_lut else None
    perm = torch.randperm(k) if has_perm else None
    return QuantizedWeight(bits, qweight, scales, mins, group_size, lut=lut, perm=perm)


def assert_matches_reference(out, x, weight, bias=None):
    ref = reference_linear(x, weight, bias)
    assert out.shape == ref.shape and out.dtype == x.dtype
    tol = TOLERANCE[x.dtype] * ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=TOLERANCE[x.dtype])


@pytest.mark.parametrize("has_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_quant_matmul_matches_reference(quant_matmul, case, m, dtype, has_bias):
    weight = make_weight(*case)
    x = torch.randn(m, weight.shape[1]).to(dtype)
    bias = torch.randn(N).to(dtype) if has_bias else None
    assert_matches_reference(quant_matmul(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("name", ["w8-g32-mins", "w4-g64-lut-perm"])
def test_quant_matmul_fp16(quant_matmul, name):
    weight = make_weight(*CASES[name])
    x = torch.randn(9, K).half()
    bias = torch.randn(N)  # fp32 bias with fp16 x
    assert_matches_reference(quant_matmul(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("split_k", [2, 3])
def test_quant_matmul_split_k_sums_partials(quant_matmul, split_k, dtype):
    """K = 256 is 4 tiles of 64: split 2 gives 2 tiles each, split 3 is rounded to 2 splits."""
    weight = make_weight(4, 256, 32, True, False, True)
    x = torch.randn(3, 256).to(dtype)
    bias = torch.randn(N)
    out = quant_matmul(x, weight, bias, split_k=split_k)
    assert_matches_reference(out, x, weight, bias)


def test_quant_matmul_reads_x_through_strides_and_leading_dims(quant_matmul):
    weight = make_weight(*CASES["w4-g32-mins-perm"])
    wide = torch.randn(2, 3, 2 * K)
    x = wide[..., ::2]  # [2, 3, K], column stride 2
    out = quant_matmul(x, weight)
    assert out.shape == (2, 3, N)
    assert_matches_reference(out.reshape(6, N), x.reshape(6, K), weight)


def test_quant_matmul_empty_batch(quant_matmul):
    weight = make_weight(*CASES["w8-g16"])
    assert quant_matmul(torch.randn(0, K), weight).shape == (0, N)


def test_quant_matmul_rejects_bad_inputs(quant_matmul):
    weight = make_weight(*CASES["w4-g32-mins"])
    with pytest.raises(ValueError, match="in_features"):
        quant_matmul(torch.randn(2, K + 32), weight)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        quant_matmul(torch.randn(2, K).double(), weight)
    with pytest.raises(ValueError, match="bias"):
        quant_matmul(torch.randn(2, K), weight, torch.randn(N + 1))
    with pytest.raises(ValueError, match="is on meta"):
        quant_matmul(torch.randn(2, K, device="meta"), weight)
    strided = replace(weight, scales=weight.scales.t().contiguous().t())  # column-major
    with pytest.raises(ValueError, match="contiguous"):
        quant_matmul(torch.randn(2, K), strided)
    with pytest.raises(ValueError, match="split_k"):
        quant_matmul(torch.randn(2, K), weight, split_k=0)

"""The quantized-matmul C++ kernels (llmserve/kernels/cpu/quant.py) against
``layout.reference_linear`` (dequantize, then fp32 matmul), on every ISA path this CPU runs.

Tolerances:
- random x: the kernels quantize x to int8 per block of 32 with d = absmax / 127, an error of
  at most d / 2 per element (rms d / sqrt(12), about 0.6% of x's rms for Gaussian blocks where
  absmax ~ 2.5 sigma). With random weights the output's relative error is about the same, so
  ``||y - ref|| / ||ref|| < 2e-2`` holds with a 3x margin and fails on any real bug.
- two-digit activations (act_digits=2, "int8x2"): x / d = hi + lo / 128, an error of at most
  d / 256 per element, 128x below one digit: ``< 2e-4`` (measured 5e-5 to 1.1e-4).
- x already on the int8 grid of its blocks (power-of-two scales, |q| <= 127 with 127 reached),
  or a GEMM fed its own dequantized xq * xs: quantization is exact and only fp32 rounding is
  left, so ``< 1e-5``; and the SIMD paths against the scalar path (same int8 inputs, another
  summation order) also ``< 1e-5``.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from kernel_testing import mapping_flags

from llmserve.kernels.cpu import quant
from llmserve.quantization.layout import QuantizedWeight, pack_int4, reference_linear

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

QUANT_TOL = 2e-2
QUANT2_TOL = 2e-4
EXACT_TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert quant.available(), "the quantized-matmul C++ kernels failed to build (see the log)"


@pytest.fixture(params=quant.ISAS)
def isa(request):
    if request.param not in quant.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    return request.param


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def make_weight(bits, n, k, group_size, mins=False, lut=False) -> QuantizedWeight:
    if bits == 8:  # the full int8 range, -128 included
        qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    else:
        qweight = pack_int4(torch.randint(0, 16, (n, k)))
    scales = torch.rand(n, k // group_size) * 0.02 + 0.002
    min_values = torch.randn(n, k // group_size) * 0.05 if mins else None
    lut_values = torch.randint(-128, 128, (16,), dtype=torch.int8) if lut else None
    return QuantizedWeight(bits, qweight, scales, min_values, group_size, lut_values)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def grid_activations(m: int, k: int) -> torch.Tensor:
    """x on the int8 grid of every 32-block: q * 2^e, |q| <= 127, one |q| = 127 per block."""
    q = torch.randint(-127, 128, (m, k // 32, 32)).float()
    q[:, :, 0] = 127 * torch.where(torch.rand(m, k // 32) < 0.5, -1.0, 1.0)
    scale = torch.pow(2.0, torch.randint(-9, -3, (m, k // 32, 1)).float())
    return (q * scale).reshape(m, k)


# (bits, K, group_size, mins, lut): G = 16, 32, 64, 128 and K; an odd number of 32-blocks
# (K = 160, 288: the last pair of blocks is half padding); G = 96 straddles block pairs.
CASES = {
    "q8-g16": (8, 192, 16, False, False),
    "q8-g16-mins": (8, 160, 16, True, False),
    "q8-g32": (8, 192, 32, False, False),
    "q8-g32-odd": (8, 160, 32, False, False),
    "q8-g64-mins": (8, 256, 64, True, False),
    "q8-g128": (8, 256, 128, False, False),
    "q8-gK": (8, 192, 192, False, False),
    "q8-g96-odd": (8, 288, 96, True, False),
    "q4-g32-mins": (4, 192, 32, True, False),
    "q4-g32-lut": (4, 192, 32, False, True),
    "q4-g32-odd-mins-lut": (4, 160, 32, True, True),
    "q4-g64-mins-lut": (4, 256, 64, True, True),
    "q4-g128": (4, 256, 128, False, False),
    "q4-gK-mins": (4, 160, 160, True, False),
    "q4-g96-odd-lut": (4, 288, 96, False, True),
}
N = 37  # not a multiple of the 4-row tile


@pytest.mark.parametrize("m", [1, 3, 17, 70])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case, m, isa, threads):
    bits, k, group_size, mins, lut = case
    weight = make_weight(bits, N, k, group_size, mins, lut)
    x = torch.randn(m, k)
    bias = torch.randn(N) if m % 2 else None
    y = quant.quant_linear(x, weight, bias, isa=isa)
    assert y.shape == (m, N) and y.dtype == torch.float32
    assert rel_err(y, reference_linear(x, weight, bias)) < QUANT_TOL
    if isa != "scalar":  # same int8 inputs as the scalar path: only the summation order differs
        assert rel_err(y, quant.quant_linear(x, weight, bias, isa="scalar")) < EXACT_TOL


@pytest.mark.parametrize("m", [1, 5, 70])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_two_digit_activations_match_reference(case, m, isa, threads):
    bits, k, group_size, mins, lut = case
    weight = make_weight(bits, N, k, group_size, mins, lut)
    x = torch.randn(m, k)
    x[:, 7] *= 40  # an outlier column: its blocks get a coarse scale
    bias = torch.randn(N)
    ref = reference_linear(x, weight, bias)
    y = quant.quant_linear(x, weight, bias, isa=isa, act_digits=2)
    assert rel_err(y, ref) < QUANT2_TOL
    one_digit = quant.quant_linear(x, weight, bias, isa=isa, act_digits=1)
    assert rel_err(y, ref) < rel_err(one_digit, ref) / 30  # the second digit is used
    if isa != "scalar":  # same digits as the scalar path: only the summation order differs
        assert (
            rel_err(y, quant.quant_linear(x, weight, bias, isa="scalar", act_digits=2)) < EXACT_TOL
        )


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_exact_on_int8_grid(case, isa, threads):
    bits, k, group_size, mins, lut = case
    weight = make_weight(bits, N, k, group_size, mins, lut)
    x = grid_activations(17, k)
    bias = torch.randn(N)
    y = quant.quant_linear(x, weight, bias, isa=isa)
    assert rel_err(y, reference_linear(x, weight, bias)) < EXACT_TOL


def test_quantize_activations():
    x = torch.randn(5, 96) * torch.rand(5, 96) * 3
    x[2, 32:64] = 0.0
    xq, xs = quant.quantize_activations(x)
    assert xq.dtype == torch.int8 and xq.shape == (5, 96) and xs.shape == (5, 3)
    absmax = x.reshape(5, 3, 32).abs().amax(-1)  # [5, 3]
    torch.testing.assert_close(xs, absmax / 127)
    assert xq.abs().max() <= 127 and xq[2, 32:64].abs().sum() == 0 and xs[2, 1] == 0
    assert (xq.reshape(5, 3, 32).abs().amax(-1)[absmax > 0] == 127).all()
    dequantized = (xq.float().reshape(5, 3, 32) * xs[..., None]).reshape(5, 96)
    assert ((dequantized - x).abs() <= xs.repeat_interleave(32, 1) / 2 * 1.0001).all()


@pytest.mark.parametrize("case", ["q8-g16-mins", "q4-g32-odd-mins-lut", "q8-gK"])
def test_gemm_from_precomputed_activations(case, isa, threads):
    bits, k, group_size, mins, lut = CASES[case]
    weight = make_weight(bits, N, k, group_size, mins, lut)
    xq, xs = quant.quantize_activations(torch.randn(9, k))
    dequantized = (xq.float().reshape(9, -1, 32) * xs[..., None]).reshape(9, k)
    bias = torch.randn(N)
    y = quant.quant_gemm(xq, xs, weight, bias, isa=isa)
    assert rel_err(y, reference_linear(dequantized, weight, bias)) < EXACT_TOL


def test_gemm_with_one_scale_per_row(isa):
    """LLM.int8's activations: one absmax per row, its scale repeated for every block."""
    weight = make_weight(8, N, 256, 256)
    x = torch.randn(6, 256)
    row_scale = x.abs().amax(1, keepdim=True) / 127  # [6, 1]
    xq = torch.round(x / row_scale).to(torch.int8)
    xs = row_scale.expand(6, 256 // 32).contiguous()
    y = quant.quant_gemm(xq, xs, weight, isa=isa)
    assert rel_err(y, reference_linear(xq.float() * row_scale, weight)) < EXACT_TOL


def test_perm_and_leading_dims(isa):
    weight = make_weight(4, N, 256, 128, mins=True)
    weight = QuantizedWeight(**{**weight.__dict__, "perm": torch.randperm(256)})
    x = torch.empty(6, 256)
    x[:, weight.perm] = grid_activations(6, 256)  # on the grid in the stored column order
    x = x.reshape(2, 3, 256)
    y = quant.quant_linear(x, weight, isa=isa)
    assert y.shape == (2, 3, N)
    assert rel_err(y, reference_linear(x, weight)) < EXACT_TOL


def test_auto_isa_is_the_best_supported():
    supported = quant.supported_isas()
    assert "scalar" in supported
    assert quant.auto_isa() == supported[0]


def _raw_args(k=64, n=8, bits=8, group_size=32):
    qweight = torch.zeros(
        n, k if bits == 8 else k // 2, dtype=torch.int8 if bits == 8 else torch.uint8
    )
    return dict(x=torch.randn(3, k), qweight=qweight, scales=torch.ones(n, k // group_size),
                mins=None, lut=None, perm=None, bits=bits, group_size=group_size, bias=None,
                isa="auto")  # fmt: skip


BAD_INPUTS = {
    "x-float64": ({"x": torch.randn(3, 64, dtype=torch.float64)}, "x must be float32"),
    "k-not-32": (_raw_args(k=48, group_size=16) | {"x": torch.randn(3, 48)}, "multiple of 32"),
    "scales-shape": ({"scales": torch.ones(8, 3)}, "scales"),
    "scales-dtype": ({"scales": torch.ones(8, 2, dtype=torch.float16)}, "scales must be"),
    "qweight-dtype": ({"qweight": torch.zeros(8, 64, dtype=torch.uint8)}, "qweight must be"),
    "qweight-shape": ({"qweight": torch.zeros(8, 32, dtype=torch.int8)}, "qweight must be"),
    "bits": ({"bits": 3}, "bits must be 4 or 8"),
    "g16-4bit": (_raw_args(bits=4, group_size=16), "group_size"),
    "lut-8bit": ({"lut": torch.zeros(16, dtype=torch.int8)}, "lut is only allowed"),
    "bias-shape": ({"bias": torch.zeros(7)}, "bias"),
    "perm-range": ({"perm": torch.full((64,), 64)}, "perm values"),
    "isa-unknown": ({"isa": "sse9"}, "isa must be one of"),
    "act-digits": ({"act_digits": 3}, "act_digits must be 1"),
}


@pytest.mark.parametrize("override, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises(override, message):
    args = _raw_args() | override
    with pytest.raises(RuntimeError, match=message):
        torch.ops.llmserve_quant.quant_linear(**args)


def test_bad_precomputed_activations_raise():
    weight = make_weight(8, 8, 64, 32)
    xq, xs = quant.quantize_activations(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="-128"):
        quant.quant_gemm(torch.full_like(xq, -128), xs, weight)
    with pytest.raises(RuntimeError, match="xs"):
        quant.quant_gemm(xq, xs[:, :1].contiguous(), weight)
    with pytest.raises(RuntimeError, match="xq must be"):
        quant.quant_gemm(xq.float(), xs, weight)


@pytest.mark.parametrize("forced", ["avx512_vnni", "avx2"])
def test_unsupported_isa_raises(forced):
    if forced in quant.supported_isas():
        pytest.skip(f"this CPU runs {forced}")
    with pytest.raises(RuntimeError, match="not supported by this CPU"):
        quant.quant_linear(torch.randn(1, 64), make_weight(8, 8, 64, 32), isa=forced)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
    monkeypatch.setattr(quant.LIBRARY, "_ok", None)
    assert quant.available() is False


# ---- float-activation kernel (the engine's default CPU path) ---------------------------------
F32_CASES = [
    (4, 32, True, False, False),
    (4, 64, False, True, False),  # lut (NF4/FP4): portable path
    (4, 128, True, False, True),  # act-order perm
    (8, 16, False, False, False),  # GGUF Q6_K groups of 16
    (8, 32, True, False, False),
    (8, 256, False, False, True),  # per channel (G = K)
]


@pytest.mark.parametrize("bits,group,with_mins,with_lut,with_perm", F32_CASES)
@pytest.mark.parametrize("m", [1, 3, 5, 16, 40])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_quant_linear_f32_matches_reference(
    bits, group, with_mins, with_lut, with_perm, m, threads, path
):
    from llmserve.kernels.cpu import quant
    from llmserve.quantization.layout import QuantizedWeight, pack_int4, reference_linear

    if not quant.available():
        pytest.skip("the quantized-matmul C++ kernels did not build")
    n, k = 70, 256
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k)))
    else:
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    weight = QuantizedWeight(
        bits, qweight, torch.rand(n, k // group) * 0.02,
        torch.randn(n, k // group) * 0.02 if with_mins else None, group,
        torch.randint(-127, 128, (16,), dtype=torch.int8) if with_lut else None,
        torch.randperm(k) if with_perm else None,
    )  # fmt: skip
    x, bias = torch.randn(m, k), torch.randn(n)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = quant.quant_linear_f32(x, weight, bias, isa=path)
    except RuntimeError as exc:
        if "this CPU has no" in str(exc):
            pytest.skip(str(exc))
        raise
    finally:
        torch.set_num_threads(previous)
    expected = reference_linear(x, weight, bias)
    assert ((out - expected).norm() / expected.norm()).item() < 1e-5  # summation order only


def test_quant_linear_f32_bad_input():
    from llmserve.kernels.cpu import quant
    from llmserve.quantization.layout import QuantizedWeight, pack_int4

    if not quant.available():
        pytest.skip("the quantized-matmul C++ kernels did not build")
    weight = QuantizedWeight(
        4, pack_int4(torch.zeros(4, 64, dtype=torch.long)), torch.ones(4, 2), None, 32
    )
    with pytest.raises(RuntimeError, match="x must be float32"):
        quant.quant_linear_f32(torch.zeros(2, 64, dtype=torch.float64), weight)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        quant.quant_linear_f32(torch.zeros(2, 32), weight)


@pytest.mark.parametrize("bits,group,with_mins,with_perm", [(4, 32, True, False), (8, 16, False, False), (4, 64, True, True)])  # fmt: skip
@pytest.mark.parametrize("m", [16, 70])
def test_bf16_gemm_path(bits, group, with_mins, with_perm, m):
    """From 16 rows, bf16_gemm decodes bf16 tiles for oneDNN's bf16 GEMM where the CPU has
    AVX512_BF16: bf16's 8-bit mantissa on weights, x and y gives ~3e-3 relative error (< 1e-2
    asserted); elsewhere it falls back to the fp32 path, exact up to summation order."""
    n, k = 300, 256
    qweight = pack_int4(torch.randint(0, 16, (n, k))) if bits == 4 else torch.randint(-127, 128, (n, k), dtype=torch.int8)  # fmt: skip
    weight = QuantizedWeight(
        bits, qweight, torch.rand(n, k // group) * 0.02,
        torch.randn(n, k // group) * 0.02 if with_mins else None, group, None,
        torch.randperm(k) if with_perm else None,
    )  # fmt: skip
    x, bias = torch.randn(m, k), torch.randn(n)
    expected = reference_linear(x, weight, bias)
    error = rel_err(quant.quant_linear_f32(x, weight, bias, bf16_gemm=True), expected)
    if quant.has_bf16_gemm():
        assert 1e-4 < error < 1e-2  # really rounded to bf16, and no worse
    else:
        assert error < EXACT_TOL


def test_auto_mode_picks_by_rows():
    weight = make_weight(4, 40, 256, 32, mins=True)
    auto = quant.linear_function("auto")
    small, large = torch.randn(3, 256), torch.randn(40, 256)
    decode = (
        quant.quant_linear_f32(small, weight)
        if quant.float_decodes_faster()  # AVX-512: the float kernel streams faster (no lut)
        else quant.quant_linear(small, weight, act_digits=2)
    )
    assert torch.equal(auto(small, weight), decode)
    assert not torch.equal(
        quant.quant_linear_f32(small, weight), quant.quant_linear(small, weight, act_digits=2)
    )
    code_book = make_weight(4, 40, 256, 64, lut=True)  # NF4-like: int8x2 at decode sizes
    assert torch.equal(auto(small, code_book), quant.quant_linear(small, code_book, act_digits=2))
    assert torch.equal(auto(large, weight), quant.quant_linear_f32(large, weight, bf16_gemm=True))
    with pytest.raises(AssertionError):
        quant.linear_function("int4")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_quantized_blocks_move_to_huge_pages_with_a_tied_embedding():
    """Every QuantLinear's codes and scales move into one MADV_HUGEPAGE region; a part two
    layers share is moved once, a tied quantized embedding follows its LM head's part, and
    the layers compute what they computed before."""
    from torch import nn

    from llmserve.quantization.int8 import quantize_int8
    from llmserve.quantization.linear import QuantEmbedding, QuantLinear, move_to_huge_pages

    torch.manual_seed(0)
    head = quantize_int8(torch.randn(2048, 1024))  # 2 MiB of codes
    model = nn.Module()
    model.embed = QuantEmbedding(head, torch.float32)
    model.lm_head = QuantLinear([head], kernel="cpu")
    model.again = QuantLinear([head], kernel="cpu")  # the same part in a second layer
    model.proj = QuantLinear([quantize_int8(torch.randn(512, 1024))], kernel="cpu")
    x = torch.randn(3, 1024)
    want = [layer(x) for layer in (model.lm_head, model.again, model.proj)]
    ids = torch.tensor([0, 5, 2047])
    want_rows = model.embed(ids)
    assert move_to_huge_pages(model) >= head.qweight.nbytes + 512 * 1024
    moved = model.lm_head.parts[0]
    assert moved is not head and model.again.parts[0] is moved and model.embed.weight_q is moved
    for part in (moved, model.proj.parts[0]):
        for tensor in (part.qweight, part.scales):
            assert "hg" in mapping_flags(tensor.data_ptr())
    got = [layer(x) for layer in (model.lm_head, model.again, model.proj)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(model.embed(ids), want_rows)

"""Run-time quantizers: int8 (W8A16), bitsandbytes NF4/FP4 (+ double quant), LLM.int8().

The bitsandbytes formats are checked code for code against bitsandbytes itself on CPU
(pinned in the test extra: bitsandbytes==0.50.2); those tests skip when it is missing.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.quantization.bnb_4bit import (
    Bnb4bitWeight,
    code_book,
    dequantize_4bit,
    dynamic_code_map,
    quantize_4bit,
    to_internal,
)
from llmserve.quantization.int8 import quantize_int8
from llmserve.quantization.layout import reference_linear, unpack_int4
from llmserve.quantization.linear import QuantLinear
from llmserve.quantization.llm_int8 import LLMInt8Linear, int8_matmul, scaled_int8_matmul
from llmserve.quantization.loading import graph_capturable


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def bnb_functional():
    """``bitsandbytes.functional``, or a skip saying why it cannot run on CPU here."""
    try:
        import bitsandbytes.functional as F
    except Exception as exc:  # ImportError, or a broken native library
        pytest.skip(f"bitsandbytes cannot be imported: {exc!r}")
    try:
        F.quantize_4bit(torch.randn(4, 64), quant_type="nf4")
        F.quantize_blockwise(torch.randn(256), blocksize=256)
    except Exception as exc:
        pytest.skip(f"bitsandbytes has no working CPU backend: {exc!r}")
    return F


def _weight(n: int, k: int, dtype=torch.float32) -> torch.Tensor:
    """Normal weights with a wide spread of row scales, a zero run and a lone tiny value."""
    w = torch.randn(n, k) * torch.logspace(-3, 0.5, n).unsqueeze(1)  # [N, K]
    w[0, :5] = 0.0
    w[-1, 3] = 1e-7
    return w.to(dtype)


# ---- int8 (W8A16) ---------------------------------------------------------------------


def test_int8_layout_and_error_bound():
    w = _weight(48, 160)
    w[5] = 0.0  # an all-zero row
    q = quantize_int8(w)
    assert (q.bits, q.group_size, q.mins, q.qweight.dtype) == (8, 160, None, torch.int8)
    assert q.scales.shape == (48, 1)
    values = q.qweight.float()
    assert values.abs().max() <= 127
    nonzero_rows = torch.arange(48) != 5
    assert torch.all(values.abs().amax(dim=1)[nonzero_rows] == 127)  # each row's max is exact
    scale = w.abs().amax(dim=1, keepdim=True) / 127  # [N, 1]
    err = (values * q.scales - w).abs()  # [N, K]
    assert torch.all(err <= scale * 0.5 * (1 + 1e-5) + 1e-12)
    assert torch.all(q.qweight[5] == 0)


def test_int8_layer_matches_dequantized_matmul():
    w, bias = _weight(64, 256), torch.randn(64)
    q = quantize_int8(w)
    layer = QuantLinear([q], bias.clone(), kernel="torch", method="int8")
    x = torch.randn(3, 5, 256)
    expected = x @ (q.qweight.float() * q.scales).T + bias  # [3, 5, 64]
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    # and the quantization error stays small relative to the float layer
    exact = x @ w.T + bias
    rel = (layer(x) - exact).norm() / exact.norm()
    assert rel < 0.01, rel


def test_int8_rejects_bad_input():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int8(torch.randn(4, 40))
    with pytest.raises(ValueError, match="float weight"):
        quantize_int8(torch.randint(0, 3, (4, 64)))


# ---- bitsandbytes NF4 / FP4 ------------------------------------------------------------


def test_code_books_match_bitsandbytes(bnb_functional):
    F = bnb_functional
    for quant_type in ("nf4", "fp4"):
        assert torch.equal(code_book(quant_type), F.get_4bit_type(quant_type, device="cpu"))
    assert torch.equal(dynamic_code_map(), F.create_dynamic_map())


def test_nf4_code_book_values():
    nf4 = code_book("nf4")
    assert nf4[0] == -1.0 and nf4[7] == 0.0 and nf4[15] == 1.0
    assert nf4[1].item() == pytest.approx(-0.6961928009986877)
    assert torch.all(nf4[1:] > nf4[:-1])
    fp4 = code_book("fp4")
    assert torch.equal(fp4[8:], -fp4[:8]) and fp4[3] == 1.0 and fp4[2] == pytest.approx(2 / 3)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize(
    "shape,dtype",
    [((64, 256), torch.float32), ((33, 192), torch.float16), ((8, 128), torch.bfloat16)],
)
def test_4bit_matches_bitsandbytes(bnb_functional, quant_type, blocksize, shape, dtype):
    F = bnb_functional
    w = _weight(*shape, dtype=dtype)
    ours = quantize_4bit(w, quant_type, blocksize=blocksize)
    packed, state = F.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type)
    assert ours.packed.dtype == torch.uint8 and ours.packed.shape == packed.shape
    assert torch.equal(ours.packed, packed)
    assert torch.equal(ours.absmax, state.absmax)
    if shape[1] % blocksize == 0:  # else bnb 0.50's CPU dequantize misplaces the block scales
        # bitsandbytes returns the input dtype: the fp32 products, rounded once
        assert torch.equal(dequantize_4bit(ours).to(dtype), F.dequantize_4bit(packed, state))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_codes_match_bitsandbytes_on_ragged_blocks(bnb_functional, quant_type):
    """Blocks run across rows (K = 96 with blocks of 64) and the last one is partial."""
    F = bnb_functional
    w = _weight(7, 96)
    ours = quantize_4bit(w, quant_type, blocksize=64)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type=quant_type)
    assert torch.equal(ours.packed, packed) and torch.equal(ours.absmax, state.absmax)
    # bitsandbytes' own reference: each flattened block times its absmax
    values = code_book(quant_type)[ours.codes().long()]  # [672]
    scales = state.absmax.repeat_interleave(64)[: values.numel()]
    assert torch.equal(dequantize_4bit(ours), (values * scales).reshape(7, 96))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_double_quant_matches_bitsandbytes(bnb_functional, quant_type):
    F = bnb_functional
    w = _weight(256, 384)  # 1536 blocks of 64 -> 6 nested blocks of 256
    ours = quantize_4bit(w, quant_type, compress_statistics=True)
    packed, state = F.quantize_4bit(w, quant_type=quant_type, compress_statistics=True)
    assert ours.is_nested and state.nested
    assert torch.equal(ours.packed, packed)
    assert torch.equal(ours.offset, state.offset)
    assert torch.equal(ours.nested_absmax, state.state2.absmax)
    assert ours.absmax.dtype == state.absmax.dtype == torch.uint8
    _check_nested_codes(w, ours, state)
    # dequantizing our state through bitsandbytes gives exactly our dequantize
    state.absmax = ours.absmax
    assert torch.equal(dequantize_4bit(ours), F.dequantize_4bit(packed, state).float())
    # 8-bit statistics: each absmax within 1% of the largest |absmax - offset|
    error = (ours.block_absmax() - w.reshape(-1, 64).abs().amax(1)).abs()
    assert error.max() <= 0.01 * ours.nested_absmax.max()


def _check_nested_codes(w: torch.Tensor, ours: Bnb4bitWeight, state) -> None:
    """Our nested codes are the nearest dynamic-map entries, as bitsandbytes' reference kernel
    and CUDA kernel pick; its >= 0.50 CPU kernel looks codes up in a 65536-bin table, so it may
    pick another entry, but only one within a bin (2 / 65535) of being as near."""
    code = dynamic_code_map()
    absmax = quantize_4bit(w, ours.quant_type).absmax  # float32, before double quant
    normed = (absmax - ours.offset) / ours.nested_absmax.repeat_interleave(256)[: absmax.numel()]
    ours_err = (code[ours.absmax.long()] - normed).abs()
    bnb_err = (code[state.absmax.long()] - normed).abs()
    assert torch.all(ours_err <= bnb_err + 1e-7)
    assert torch.all(bnb_err <= ours_err + 2 / 65535 + 1e-7)
    assert (ours.absmax == state.absmax).float().mean() > 0.9


def test_double_quant_exact_nearest_code():
    """Without bitsandbytes: every nested code is the nearest entry of the dynamic map."""
    w = _weight(128, 512)
    nested = quantize_4bit(w, "nf4", compress_statistics=True)
    absmax = quantize_4bit(w, "nf4").absmax
    normed = (absmax - nested.offset) / nested.nested_absmax.repeat_interleave(256)[
        : absmax.numel()
    ]
    code = dynamic_code_map()
    best = (code.unsqueeze(0) - normed.unsqueeze(1)).abs().min(dim=1).values  # [num_blocks]
    assert torch.allclose((code[nested.absmax.long()] - normed).abs(), best, atol=1e-7)
    assert torch.allclose(nested.offset, absmax.mean())


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
def test_internal_layout_close_to_exact_dequantize(quant_type, nested):
    w, bias = _weight(96, 320), torch.randn(96)
    packed = quantize_4bit(w, quant_type, compress_statistics=nested)
    q = to_internal(packed)
    assert (q.bits, q.group_size, q.mins) == (4, 64, None)
    assert torch.equal(q.lut, torch.round(code_book(quant_type) * 127).to(torch.int8))
    assert torch.equal(unpack_int4(q.qweight), packed.codes().reshape(96, 320))
    torch.testing.assert_close(q.scales * 127, packed.block_absmax().reshape(96, 5))
    exact = dequantize_4bit(packed)  # [N, K]
    absmax = packed.block_absmax().reshape(96, 5).repeat_interleave(64, dim=1)
    # the int8 lut moves each value by at most half a step of 1/127 of its block absmax
    assert torch.all((q.dequantize() - exact).abs() <= absmax * (0.5 / 127) * (1 + 1e-4) + 1e-9)
    x = torch.randn(7, 320)
    out = reference_linear(x, q, bias)
    expected = x @ exact.T + bias
    assert (out - expected).norm() / expected.norm() < 0.01
    # the 4-bit format itself is a coarse approximation of the float weight
    assert (exact - w).norm() / w.norm() < 0.15


def test_internal_layout_needs_row_aligned_blocks():
    with pytest.raises(ValueError, match="divisible by the block size 64"):
        to_internal(quantize_4bit(torch.randn(8, 96), "nf4"))


def test_quantize_4bit_rejects_bad_input():
    with pytest.raises(ValueError, match="quant_type"):
        quantize_4bit(torch.randn(4, 64), "int4")
    with pytest.raises(ValueError, match="blocksize"):
        quantize_4bit(torch.randn(4, 64), "nf4", blocksize=48)
    with pytest.raises(ValueError, match="even"):
        quantize_4bit(torch.randn(3, 3), "nf4")


# ---- LLM.int8() ------------------------------------------------------------------------


def _outlier_input(t: int, k: int, cols=(5, 77, 200)) -> torch.Tensor:
    """Activations ~ N(0, 1) with a few feature columns 20x larger (fp16-representable)."""
    x = torch.randn(t, k)
    x[:, list(cols)] *= 20
    return x.half().float()


def test_int8_matmul_is_exact():
    a = torch.randint(-127, 128, (5, 300), dtype=torch.int8)
    b = torch.randint(-127, 128, (9, 300), dtype=torch.int8)
    expected = (a.double() @ b.double().T).to(torch.int32)
    assert torch.equal(int8_matmul(a, b), expected)


@pytest.mark.parametrize("k", [256, 300])  # the CPU kernel's blocks of 32; _int_mm otherwise
def test_scaled_int8_matmul_equals_the_exact_product(k):
    a = torch.randint(-127, 128, (7, k), dtype=torch.int8)
    b = torch.randint(-127, 128, (40, k), dtype=torch.int8)
    sa, sb = torch.rand(7) + 0.1, torch.rand(40) + 0.1
    exact = (a.double() @ b.double().T) * sa.double()[:, None] * sb.double() / 127**2
    got = scaled_int8_matmul(a, sa, b, sb)
    assert got.dtype == torch.float32 and got.shape == (7, 40)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)


def test_llm_int8_outliers_keep_error_small():
    w = torch.randn(128, 256) * 0.05
    x = _outlier_input(16, 256)
    exact = x @ w.T
    with_outliers = LLMInt8Linear(w, threshold=6.0)(x)
    without = LLMInt8Linear(w, threshold=0.0)(x)
    err_6 = ((with_outliers - exact).norm() / exact.norm()).item()
    err_0 = ((without - exact).norm() / exact.norm()).item()
    assert err_6 < 0.01, err_6
    assert err_6 < err_0 / 4, (err_6, err_0)
    # no activation reaches the threshold: both settings compute the same thing
    calm = torch.randn(16, 256).clamp(-5, 5)
    torch.testing.assert_close(
        LLMInt8Linear(w, threshold=6.0)(calm), LLMInt8Linear(w, threshold=0.0)(calm), rtol=0, atol=0
    )


def test_llm_int8_state_and_shapes():
    linear = torch.nn.Linear(64, 40)
    layer = LLMInt8Linear.from_linear(linear)
    assert layer.CB.dtype == torch.int8 and layer.CB.shape == (40, 64)
    assert layer.SCB.dtype == torch.float32 and layer.SCB.shape == (40,)
    assert layer.weight_nbytes == 40 * 64 + 40 * 4
    assert set(layer.state_dict()) == {"CB", "SCB", "bias"}
    assert torch.equal(layer.SCB, linear.weight.detach().abs().amax(dim=1))
    x = torch.randn(2, 3, 64)
    out = layer(x)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, linear(x).detach(), rtol=0.02, atol=0.02)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert layer(torch.randn(0, 64)).shape == (0, 40)
    assert layer.to(torch.device("cpu")).CB.dtype == torch.int8


def test_llm_int8_with_outliers_is_not_graph_capturable():
    """Outlier columns come from each input (nonzero): a CUDA graph would freeze them, so the
    worker runs such a model eager; threshold 0 and the other methods keep the graphs."""
    w = torch.randn(8, 32)
    model = torch.nn.Sequential(QuantLinear([quantize_int8(w)]), LLMInt8Linear(w, None, 6.0))
    assert not graph_capturable(model)
    model[1] = LLMInt8Linear(w, None, threshold=0.0)
    assert graph_capturable(model)


def test_llm_int8_matches_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    n, k = 96, 256
    w = (torch.randn(n, k) * 0.05).half().float()  # fp16-representable: bnb quantizes in fp16
    bias = torch.randn(n).half().float()
    x = _outlier_input(12, k)
    ref = bnb.nn.Linear8bitLt(k, n, bias=True, has_fp16_weights=False, threshold=6.0)
    ref.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    ref.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    try:
        ref = ref.to("cpu").eval()
        with torch.no_grad():
            expected = ref(x)
    except Exception as exc:
        pytest.skip(f"bitsandbytes' LLM.int8 does not run on CPU here: {exc!r}")
    ours = LLMInt8Linear(w, bias, threshold=6.0)
    assert torch.equal(ours.CB, ref.state.CB) and torch.equal(ours.SCB, ref.state.SCB)
    # bitsandbytes scales by 6.200124e-05 where 1 / 127^2 = 6.2000124e-05: 2e-5 relative
    torch.testing.assert_close(ours(x), expected, rtol=1e-4, atol=1e-4)

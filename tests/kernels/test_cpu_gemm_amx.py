"""llmserve's bf16 linear by AMX tiles (kernels/cpu/gemm_amx.cpp) against the float64 product
of the same bf16 values, and ``PackedLinear`` choosing it on AMX hosts that ask for it
(``LLMSERVE_CPU_AMX_GEMM=1``).

Every host runs the kernel with its tile instructions emulated in C++ (``emulate``), which
checks what the kernel itself decides: where each tile is loaded from (the packed panels'
16-column slices, x's blocks of 16 rows), the zeroed block for rows past the last whole one,
the four row blocks a group holds, the rounding and the bias, the panels handed out to the
threads. Hosts with AMX also run the instructions and check them against both.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from kernel_testing import bf16_inputs, num_threads
from torch import nn
from torch.nn import functional as F

from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers import cpu_linear
from llmserve.layers.cpu_linear import AMX_GEMM_ENV, AMX_ROWS

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

needs_amx = pytest.mark.skipif(
    not cpu_kernels.has_amx_gemm(), reason="this CPU (or its OS) runs no AMX-BF16 tiles"
)

SHAPES = [  # (M, K, N): rows under, at and past a block of 16 and a group of 64; one panel's
    (1, 32, 1),  # column tail; K of one and of many 32-deep tiles (odd and even counts)
    (15, 64, 48),
    (16, 32, 49),
    (17, 96, 145),
    (64, 576, 96),
    (65, 64, 50),
    (130, 576, 145),
]


def amx(x, w, n, b=None, emulate=True):
    return cpu_kernels.linear_bf16_amx(x, cpu_kernels.linear_bf16_pack(w), n, b, emulate)


def assert_near_float64(got, x, w, b):
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5 * x.shape[-1] ** 0.5)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_emulated_amx_linear_matches_float64(m, k, n, with_bias):
    """fp32 sums of the bf16 products, rounded to bf16 once: within one bf16 rounding of the
    exact product."""
    x, w, b = bf16_inputs(m, k, n, with_bias, seed=m * 1000 + k + n)
    assert_near_float64(amx(x, w, n, b), x, w, b)


def test_emulated_amx_linear_rounds_like_an_fp32_product():
    """The result is the fp32 product rounded once: equal bits but where the sums' order
    moves a value across a rounding boundary."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 1536, generator=gen) * torch.randn(1, 1536, generator=gen).exp()
    w = torch.randn(96, 1536, generator=gen) * 0.05
    got = amx(x.bfloat16(), w.bfloat16(), 96)
    want = (x.bfloat16().float() @ w.bfloat16().float().T).bfloat16()
    assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("threads", [1, 3])  # 3: more threads than the CI host's cores
def test_emulated_amx_linear_computes_every_panel_at_any_thread_count(threads):
    x, w, _ = bf16_inputs(70, 64, 500, False, seed=threads)
    with num_threads(threads):
        got = amx(x, w, 500)
    assert_near_float64(got, x, w, None)


def test_emulated_amx_linear_rows_do_not_depend_on_the_batch():
    """A row alone (in the zeroed block), or in a whole block, gives the same bits."""
    x, w, b = bf16_inputs(40, 64, 100, True, seed=7)
    packed = cpu_kernels.linear_bf16_pack(w)
    batch = cpu_kernels.linear_bf16_amx(x, packed, 100, b, True)
    for rows in (slice(3, 4), slice(16, 32), slice(5, 40)):
        alone = cpu_kernels.linear_bf16_amx(x[rows], packed, 100, b, True)
        assert torch.equal(alone, batch[rows])


def test_emulated_amx_linear_keeps_leading_dims_and_reads_strided_x():
    x = torch.randn(2, 3, 128).bfloat16()[:, :, ::2]  # [2, 3, 64], not contiguous
    w = torch.randn(33, 64).bfloat16()
    got = amx(x, w, 33)
    assert got.shape == (2, 3, 33)
    assert_near_float64(got, x, w, None)


def test_amx_linear_refuses_what_it_cannot_run():
    packed = cpu_kernels.linear_bf16_pack(torch.randn(10, 48).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.linear_bf16_amx(torch.randn(2, 48).bfloat16(), packed, 10, None, True)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_kernels.linear_bf16_amx(torch.randn(2, 64), packed, 10, None, True)
    with pytest.raises(RuntimeError, match="does not hold"):
        cpu_kernels.linear_bf16_amx(torch.randn(2, 64).bfloat16(), packed, 10, None, True)
    if not cpu_kernels.has_amx_gemm():
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            cpu_kernels.linear_bf16_amx(torch.randn(2, 64).bfloat16(), packed, 10)


def test_amx_is_found_where_torch_finds_it():
    """Ours and torch's check agree: cpuid's AMX-TILE and Linux's grant of the tiles' state
    (torch asks for it in ``_init_amx``, as we do; the AMX hosts seen so far have AMX-BF16
    wherever they have the tiles)."""
    torch_sees = torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()
    assert cpu_kernels.has_amx_gemm() == torch_sees


@needs_amx
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_amx_linear_matches_float64_and_its_emulation(m, k, n, with_bias):
    x, w, b = bf16_inputs(m, k, n, with_bias, seed=m + k + n)
    got = amx(x, w, n, b, emulate=False)
    assert_near_float64(got, x, w, b)
    torch.testing.assert_close(got, amx(x, w, n, b), rtol=2**-7, atol=1e-5 * k**0.5)


@needs_amx
@pytest.mark.parametrize("threads", [1, 3])
def test_amx_linear_computes_every_panel_at_any_thread_count(threads):
    x, w, _ = bf16_inputs(130, 576, 500, False, seed=threads)
    with num_threads(threads):
        got = amx(x, w, 500, emulate=False)
    assert_near_float64(got, x, w, None)


def test_packed_linear_takes_the_amx_gemm_where_asked(monkeypatch):
    """On an AMX host with LLMSERVE_CPU_AMX_GEMM=1, bf16 layers whose in_features is a
    multiple of 32 take llmserve's AMX GEMM up to AMX_ROWS rows from a second packed copy,
    oneDNN beyond; with the variable unset or 0 they keep oneDNN alone. Off AMX hosts the
    kernel runs with its tiles emulated (the host rule is what is under test here)."""
    if not cpu_linear.has_native_bf16():
        pytest.skip("oneDNN runs no native bf16 matmul on this CPU")
    amx_runs = cpu_kernels.has_amx_gemm()  # the real answer, before the host rule is set
    monkeypatch.setattr(cpu_linear, "is_amd_zen4", lambda: False)
    monkeypatch.setattr(cpu_linear, "is_amd_zen5", lambda: False)
    monkeypatch.setattr(cpu_kernels, "widens_bf16", lambda: False)
    monkeypatch.setattr(cpu_kernels, "has_amx_gemm", lambda: True)
    real, used = cpu_kernels.linear_bf16_amx, []

    def spy(x, packed, *args):  # the real kernel (emulated off AMX), noting the copy it read
        used.append(packed)
        return real(x, packed, *args, emulate=not amx_runs)

    monkeypatch.setattr(cpu_kernels, "linear_bf16_amx", spy)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 200), nn.Linear(200, 40)).bfloat16()

    x = torch.randn(AMX_ROWS + 1, 64).bfloat16()
    monkeypatch.delenv(AMX_GEMM_ENV, raising=False)
    model = build()
    want = model(x).double()
    cpu_linear.pack_linear_layers(model)
    assert all(not layer.amx and layer.bf16_weight is None for layer in model)

    monkeypatch.setenv(AMX_GEMM_ENV, "1")
    model = build()
    cpu_linear.pack_linear_layers(model)
    first, second, third = model
    assert first.amx and second.amx and not third.amx  # 200 is no multiple of 32
    assert "AMX GEMM for up to 128 rows" in repr(first)
    for rows in (1, 17, AMX_ROWS, AMX_ROWS + 1):
        used.clear()
        got = model(x[:rows]).double()
        torch.testing.assert_close(got, want[:rows], rtol=0.05, atol=0.05)
        expected = [first.bf16_weight, second.bf16_weight] if rows <= AMX_ROWS else []
        assert [id(w) for w in used] == [id(w) for w in expected], rows


def test_amx_gemm_variable_takes_zero_or_one(monkeypatch):
    monkeypatch.setenv(AMX_GEMM_ENV, "yes")
    with pytest.raises(ValueError, match="expected 0 .* or 1"):
        cpu_linear.amx_gemm_enabled()
    monkeypatch.setenv(AMX_GEMM_ENV, "0")
    assert not cpu_linear.amx_gemm_enabled()

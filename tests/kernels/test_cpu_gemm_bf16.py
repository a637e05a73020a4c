"""llmserve's bf16 linear (kernels/cpu/gemm_bf16.cpp, AVX512_BF16 only), by vdpbf16ps and by
fp32 FMAs on widened values (``widen``), against the float64 product of the same bf16 values,
and ``PackedLinear`` choosing it for decode-sized calls on AMD Zen 4, for every call on Zen 5
and, widened, on Intel CPUs without AMX.

The shapes cover the kernel's edges: rows fewer than, equal to and past a register tile (8;
every remainder takes a tile of its own height) and past a row block (256), columns that do
not fill the last 48-column panel, K of a pair up to 300 (a tile takes a panel over all of K),
with and without bias. On a CPU without AVX512_BF16 only the refusals run.
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
from llmserve.layers.cpu_linear import (
    BF16_DECODE_ROWS,
    BF16_WIDE_ROWS,
    MAX_OWN_GEMM_FEATURES,
    WIDEN_ROWS,
)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

needs_bf16 = pytest.mark.skipif(
    not cpu_kernels.has_bf16_gemm(), reason="this CPU has no AVX512_BF16"
)

SHAPES = [  # (M, K, N)
    (1, 2, 1),
    (2, 20, 48),
    (3, 64, 7),
    (7, 128, 49),
    (8, 130, 48),
    (9, 300, 145),
    (64, 576, 96),
    (17, 256, 145),
    (300, 70, 49),
    (600, 64, 500),  # three row blocks of 256, eleven panels: one parallel region
]


@needs_bf16
@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_linear_bf16_matches_float64(m, k, n, with_bias, widen):
    """fp32 sums of the bf16 products, rounded to bf16 once: within one bf16 rounding of the
    exact product."""
    x, w, b = bf16_inputs(m, k, n, with_bias, seed=m * 1000 + k + n)
    got = cpu_kernels.linear_bf16(x, cpu_kernels.linear_bf16_pack(w), n, b, widen=widen)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5 * k**0.5)


@needs_bf16
def test_linear_bf16_rounds_like_an_fp32_product():
    """The bf16 result is the fp32 product rounded once (as oneDNN's): equal bits but where
    the fp32 sums' order moves a value across a rounding boundary."""
    gen = torch.Generator().manual_seed(3)
    x = (
        torch.randn(20, 1536, generator=gen) * torch.randn(1, 1536, generator=gen).exp()
    ).bfloat16()
    w = (torch.randn(576, 1536, generator=gen) * 0.05).bfloat16()
    got = cpu_kernels.linear_bf16(x, cpu_kernels.linear_bf16_pack(w), 576)
    want = (x.float() @ w.float().T).bfloat16()
    assert (got == want).float().mean() >= 0.99


@needs_bf16
@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("threads", [1, 3])  # 3: more threads than the CI host's cores
@pytest.mark.parametrize(("m", "n"), [(64, 500), (300, 500), (130, 4050)])
def test_linear_bf16_computes_every_panel_at_any_thread_count(m, n, threads, widen):
    x, w, _ = bf16_inputs(m, 200, n, False, seed=m + threads)
    packed = cpu_kernels.linear_bf16_pack(w)
    with num_threads(threads):
        got = cpu_kernels.linear_bf16(x, packed, n, widen=widen)
    want = F.linear(x.double(), w.double())
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5 * 200**0.5)


@needs_bf16
@pytest.mark.parametrize("widen", [False, True])
def test_linear_bf16_rows_do_not_depend_on_the_batch(widen):
    """A row alone, or in a tile of another height, gives the same bits: each output is the
    same in-order sum over k."""
    x, w, b = bf16_inputs(19, 300, 145, True, seed=7)
    packed = cpu_kernels.linear_bf16_pack(w)
    batch = cpu_kernels.linear_bf16(x, packed, 145, b, widen=widen)
    for rows in (slice(3, 4), slice(5, 12)):
        alone = cpu_kernels.linear_bf16(x[rows], packed, 145, b, widen=widen)
        assert torch.equal(alone, batch[rows])


@needs_bf16
def test_widened_bf16_sums_as_the_fp32_gemm():
    """Widened, each product is exact in fp32 and the sums run in order over k, as in
    llmserve's fp32 GEMM on the same values: the same bits once rounded to bf16."""
    x, w, _ = bf16_inputs(37, 1536, 200, False, seed=11)
    got = cpu_kernels.linear_bf16(x, cpu_kernels.linear_bf16_pack(w), 200, widen=True)
    fp32 = cpu_kernels.linear_f32(x.float(), cpu_kernels.linear_f32_pack(w.float()), 200)
    assert torch.equal(got, fp32.bfloat16())


@needs_bf16
@pytest.mark.parametrize("widen", [False, True])
def test_linear_bf16_keeps_leading_dims_and_reads_strided_x(widen):
    x = torch.randn(2, 3, 40).bfloat16()[:, :, ::2]  # [2, 3, 20], not contiguous
    w = torch.randn(33, 20).bfloat16()
    got = cpu_kernels.linear_bf16(x, cpu_kernels.linear_bf16_pack(w), 33, widen=widen)
    assert got.shape == (2, 3, 33)
    torch.testing.assert_close(
        got.double(), F.linear(x.double(), w.double()), rtol=2**-8, atol=1e-4
    )


def test_linear_bf16_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_kernels.linear_bf16_pack(torch.randn(10, 16))
    with pytest.raises(RuntimeError, match="even"):
        cpu_kernels.linear_bf16_pack(torch.randn(10, 15).bfloat16())
    packed = cpu_kernels.linear_bf16_pack(torch.randn(10, 16).bfloat16())
    x = torch.randn(2, 18).bfloat16()
    # a CPU without AVX512_BF16 refuses every call; one with it, the mismatched weight
    match = "does not hold" if cpu_kernels.has_bf16_gemm() else "AVX512_BF16"
    with pytest.raises(RuntimeError, match=match):
        cpu_kernels.linear_bf16(x, packed, 10)


@pytest.mark.parametrize("host", ["other", "zen4", "zen5", "intel_no_amx"])
def test_packed_linear_takes_the_bf16_gemm_where_it_is_faster(host, monkeypatch):
    """On Zen 4, bf16 layers take llmserve's GEMM up to BF16_DECODE_ROWS rows (the LM head's
    width up to BF16_WIDE_ROWS) from a second packed copy, and oneDNN beyond; on Zen 5 and on
    Intel without AMX (widened there) they keep only llmserve's copy and take it at every row
    count, widened from more than WIDEN_ROWS rows; elsewhere (Intel with AMX among them)
    oneDNN throughout."""
    if not cpu_linear.has_native_bf16():
        pytest.skip("oneDNN runs no native bf16 matmul on this CPU")
    if host != "other" and not cpu_kernels.has_bf16_gemm():
        pytest.skip("this CPU has no AVX512_BF16")
    zen4, zen5, widen = host == "zen4", host == "zen5", host == "intel_no_amx"
    monkeypatch.setattr(cpu_linear, "is_amd_zen4", lambda: zen4)
    monkeypatch.setattr(cpu_linear, "is_amd_zen5", lambda: zen5)
    monkeypatch.setattr(cpu_kernels, "widens_bf16", lambda: widen)
    own = zen5 or widen
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 96), nn.Linear(96, MAX_OWN_GEMM_FEATURES + 1, bias=False)
    ).bfloat16()
    x = torch.randn(BF16_DECODE_ROWS + 1, 64).bfloat16()
    want = model(x).double()
    assert cpu_linear.pack_linear_layers(model) == 2
    first, head = model[0], model[1]
    assert (first.bf16_weight is not None) == zen4 and (head.bf16_weight is not None) == zen4
    assert first.own_bf16_gemm == own and head.own_bf16_gemm == own
    real, used = cpu_kernels.linear_bf16, []

    def spy(x, packed, *args):  # the real kernel, noting which layer's copy it read and how
        used.append(packed)
        widened.append(len(args) > 2 and args[2])
        return real(x, packed, *args)

    monkeypatch.setattr(cpu_kernels, "linear_bf16", spy)
    for rows in (1, WIDEN_ROWS, WIDEN_ROWS + 1, BF16_WIDE_ROWS, BF16_WIDE_ROWS + 1,
                 BF16_DECODE_ROWS, BF16_DECODE_ROWS + 1):  # fmt: skip
        used.clear()
        widened = []
        got = model(x[:rows]).double()
        torch.testing.assert_close(got, want[:rows], rtol=0.05, atol=0.05)
        expected = []
        if own:
            expected = [first.packed_weight, head.packed_weight]
        if zen4 and rows <= BF16_DECODE_ROWS:
            expected.append(first.bf16_weight)
        if zen4 and rows <= BF16_WIDE_ROWS:
            expected.append(head.bf16_weight)
        assert [id(w) for w in used] == [id(w) for w in expected], rows
        assert widened == [widen and rows > WIDEN_ROWS] * len(used), rows


@needs_bf16
def test_linear_benchmark_times_the_bf16_kernels_in_turns():
    """``benchmarks.fp32_linear --dtype bfloat16``: every layer shape, each kernel once per
    round, llmserve's bf16 GEMM among them, and the table has a cell for each."""
    from llmserve.benchmarks import fp32_linear

    results = fp32_linear.measure([2], layers=2, budget_s=0.0, dtype=torch.bfloat16, rounds=2)
    kernels = {r["kernel"] for r in results}
    assert {"llmserve linear_bf16", "llmserve widened", "F.linear"} <= kernels
    assert len(results) == 5 * len(kernels)  # SmolLM2's five shapes
    assert all(r["us"] > 0 and r["gflops"] > 0 for r in results)
    table = fp32_linear.format_table(results)
    assert table.count("\n") == 2 + 5 - 1 and "linear_bf16" in table

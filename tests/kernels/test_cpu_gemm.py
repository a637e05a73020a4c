"""llmserve's fp32 linear (kernels/cpu/gemm.cpp) on every instruction-set path this CPU runs,
against ``F.linear`` in float64, and ``PackedLinear`` choosing it in a model.

The shapes cover the kernel's edges: rows fewer than, equal to and past a register tile (8
with AVX-512, 4 with AVX2; every remainder, which takes a tile of its own height) and past a
row block (256), columns that do not fill the last 48-column panel, K shorter than, equal to
and past a slice (128), with and without bias, in both orders of decode-sized calls (slice by
slice, and ``whole_panels``: panel by panel over all of K).
"""

from __future__ import annotations

import mmap
import shutil
import sys

import pytest
import torch
from kernel_testing import mapping_field, mapping_flags, num_threads
from torch import nn
from torch.nn import functional as F

from llmserve import cpuinfo
from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers import cpu_linear
from llmserve.layers.cpu_linear import (
    FP32_DECODE_ROWS,
    FP32_INTEL_ROWS,
    MAX_OWN_GEMM_FEATURES,
    PackedLinear,
    pack_linear_layers,
)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def _inference_mode():
    """Layers run as the engine runs them: oneDNN's linear on an input that carries autograd
    history took 5-6 s per call on an AVX2 host (the packed-layer tests' 17 s)."""
    with torch.inference_mode():
        yield


SHAPES = [  # (M, K, N)
    (1, 1, 1),
    (2, 20, 48),
    (1, 300, 145),  # one and two rows take whole panels over all of K (gemv_panels)
    (2, 129, 200),
    (3, 5, 7),
    (5, 33, 50),
    (6, 40, 96),
    (7, 64, 49),
    (8, 128, 48),
    (9, 129, 50),
    (64, 300, 96),
    (17, 256, 145),
    (300, 70, 49),
]


@pytest.mark.parametrize("whole_panels", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_linear_f32_matches_float64(isa, m, k, n, with_bias, whole_panels):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    packed = cpu_kernels.linear_f32_pack(w)
    got = cpu_kernels.linear_f32(x, packed, n, b, whole_panels=whole_panels)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * (k**0.5))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), [(3, 129, 200), (64, 300, 96), (17, 256, 145)])
def test_linear_f32_whole_panels_gives_the_sliced_orders_bits(isa, m, k, n, with_bias):
    """Panel by panel over all of K or slice by slice, each output is the same sum over k in
    order (a slice's partial sum is stored and re-loaded as fp32, exactly)."""
    gen = torch.Generator().manual_seed(m + k + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    packed = cpu_kernels.linear_f32_pack(w)
    sliced = cpu_kernels.linear_f32(x, packed, n, b)
    assert torch.equal(cpu_kernels.linear_f32(x, packed, n, b, whole_panels=True), sliced)


@pytest.mark.parametrize("whole_panels", [False, True])
@pytest.mark.parametrize("threads", [1, 3])  # 3: more threads than the CI host's cores
# one pass over the weight; blocks of 256 rows; chunks cut to keep y in L2 (85 panels, the
# last chunk short)
@pytest.mark.parametrize(("m", "n"), [(64, 500), (300, 500), (200, 4050)])
def test_linear_f32_computes_every_panel_at_any_thread_count(m, n, threads, whole_panels):
    """Panels are handed out in chunks that threads take as they come free (parallel.h): with
    one thread, and with more threads than cores, no output column is left out."""
    gen = torch.Generator().manual_seed(m + threads)
    x, w = torch.randn(m, 200, generator=gen), torch.randn(n, 200, generator=gen)
    packed = cpu_kernels.linear_f32_pack(w)
    with num_threads(threads):
        got = cpu_kernels.linear_f32(x, packed, n, whole_panels=whole_panels)
    want = F.linear(x.double(), w.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * (200**0.5))


@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_f32_rows_do_not_depend_on_the_batch(isa, with_bias):
    """One or two rows (whole panels, one stream) give the same bits as the same rows inside a
    larger batch (register tiles, slice by slice): each output is the same in-order sum."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(9, 300, generator=gen), torch.randn(145, 300, generator=gen)
    b = torch.randn(145, generator=gen) if with_bias else None
    packed = cpu_kernels.linear_f32_pack(w)
    batch = cpu_kernels.linear_f32(x, packed, 145, b)
    assert torch.equal(cpu_kernels.linear_f32(x[3:4], packed, 145, b), batch[3:4])
    assert torch.equal(cpu_kernels.linear_f32(x[5:7], packed, 145, b), batch[5:7])


def test_linear_f32_keeps_leading_dims_and_reads_strided_x(isa):
    x = torch.randn(2, 3, 40)[:, :, ::2]  # [2, 3, 20], not contiguous
    w = torch.randn(33, 20)
    got = cpu_kernels.linear_f32(x, cpu_kernels.linear_f32_pack(w), 33)
    assert got.shape == (2, 3, 33)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_f32_refuses_a_mismatched_weight():
    packed = cpu_kernels.linear_f32_pack(torch.randn(10, 16))
    with pytest.raises(RuntimeError, match="does not hold"):
        cpu_kernels.linear_f32(torch.randn(2, 17), packed, 10)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.linear_f32_pack(torch.randn(10, 16, dtype=torch.bfloat16))


def pretend_host(monkeypatch, host: str) -> None:
    """cpu_linear's view of the CPU: ``zen4``, ``intel`` or ``other`` (Zen 5 and Zen 3 alike)."""
    monkeypatch.setattr(cpu_linear, "is_amd_zen4", lambda: host == "zen4")
    monkeypatch.setattr(cpu_linear, "is_intel", lambda: host == "intel")


@pytest.mark.parametrize("host", ["other", "zen4", "intel"])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_packed_linear_takes_the_fp32_gemm_measured_faster_per_host_and_size(
    isa, host, monkeypatch
):
    """Layers take llmserve's GEMM; the LM head's width takes oneDNN with AVX-512, ours with
    AVX2 (measured faster on each). On AMD Zen 4, and on Intel with AVX-512, oneDNN takes
    every layer but decode-sized calls, which read a second copy packed for ours: on Zen 4 up
    to FP32_DECODE_ROWS rows below the LM head's width and one or two at it, on Intel up to
    FP32_INTEL_ROWS below it and none at it."""
    if isa not in cpu_kernels.supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    pretend_host(monkeypatch, host)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, MAX_OWN_GEMM_FEATURES + 1, bias=False))
    x = torch.randn(FP32_INTEL_ROWS + 1, 64)
    want = model(x)  # unpacked
    with cpu_kernels.forced_isa(isa):
        split = host == "zen4" or (host == "intel" and isa == "avx512")  # oneDNN's prompts
        rows_of_ours = {"zen4": (FP32_DECODE_ROWS, 2), "intel": (FP32_INTEL_ROWS, 0)}
        assert pack_linear_layers(model) == 2
        first, head = model[0], model[1]
        assert isinstance(first, PackedLinear) and first.own_gemm == (not split)
        assert isinstance(head, PackedLinear) and head.own_gemm == (isa == "avx2" and not split)
        ours = rows_of_ours[host] if split else (0, 0)
        assert (first.f32_rows, head.f32_rows) == ours
        assert [layer.f32_weight is not None for layer in (first, head)] == [r > 0 for r in ours]
        real_linear_f32, weights_used = cpu_kernels.linear_f32, []

        def spy(x, packed, *args, **kwargs):  # the real kernel, noting which weight it read
            weights_used.append(packed)
            return real_linear_f32(x, packed, *args, **kwargs)

        monkeypatch.setattr(cpu_kernels, "linear_f32", spy)
        for rows in (1, 2, 3, FP32_DECODE_ROWS, FP32_DECODE_ROWS + 1, FP32_INTEL_ROWS + 1):
            weights_used.clear()
            torch.testing.assert_close(model(x[:rows]), want[:rows], rtol=1e-4, atol=1e-4)
            if split:  # each layer: its copy for ours up to its rows, oneDNN's beyond
                expected = [
                    layer.f32_weight
                    for layer, most in zip((first, head), ours, strict=True)
                    if rows <= most
                ]
                assert [id(w) for w in weights_used] == [id(w) for w in expected]


@pytest.mark.parametrize("zen5", [False, True])
def test_zen5_takes_decode_sized_calls_panel_by_panel(zen5, monkeypatch):
    """Where llmserve's fp32 GEMM is a layer's only kernel, AMD Zen 5 runs calls of up to
    FP32_DECODE_ROWS rows panel by panel (whole_panels) and larger ones slice by slice; other
    hosts slice by slice throughout. Either order computes the same product."""
    pretend_host(monkeypatch, "other")
    monkeypatch.setattr(cpu_linear, "is_amd_zen5", lambda: zen5)
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    x = torch.randn(FP32_DECODE_ROWS + 1, 64)
    want = layer(x)
    packed = PackedLinear(layer, 64)
    if not packed.own_gemm:
        pytest.skip("llmserve's fp32 GEMM does not build here")
    real_linear_f32, orders = cpu_kernels.linear_f32, []

    def spy(*args, whole_panels=False):
        orders.append(whole_panels)
        return real_linear_f32(*args, whole_panels=whole_panels)

    monkeypatch.setattr(cpu_kernels, "linear_f32", spy)
    for rows in (1, FP32_DECODE_ROWS, FP32_DECODE_ROWS + 1):
        torch.testing.assert_close(packed(x[:rows]), want[:rows], rtol=1e-4, atol=1e-4)
    assert orders == [zen5, zen5, False]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
@pytest.mark.parametrize("host", ["other", "zen4", "intel"])
def test_copies_for_our_gemm_sit_in_huge_pages(host, monkeypatch):
    """After packing, every weight copy llmserve's GEMM reads (a plain tensor: the decode
    copies of Zen 4 and Intel, elsewhere the layers' only copies) lies in one mapping marked
    MADV_HUGEPAGE, one after the other on pages of their own, resident, and the layers compute
    what they computed before the move."""
    pretend_host(monkeypatch, host)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512, bias=False))  # 4 MiB
    x = torch.randn(8, 512)
    want = model(x)
    pack_linear_layers(model)
    copies = [
        getattr(layer, name)
        for layer in model
        for name in PackedLinear.OWN_WEIGHTS
        if getattr(layer, name) is not None and not getattr(layer, name).is_mkldnn
    ]
    assert len(copies) == 2  # one per layer: a decode copy, or the only one
    for copy in copies:
        assert copy.data_ptr() % 4096 == 0 and "hg" in mapping_flags(copy.data_ptr())
    first_pages = -(-copies[0].nbytes // 4096) * 4096
    assert copies[1].data_ptr() == copies[0].data_ptr() + first_pages  # one region, in order
    rss_kib = int(mapping_field(copies[0].data_ptr(), "Rss:")[0])
    assert rss_kib * 1024 >= sum(c.nbytes for c in copies)  # written, so resident
    for rows in (1, 8):
        torch.testing.assert_close(model(x[:rows]), want[:rows], rtol=1e-4, atol=1e-4)


def test_nothing_to_move_moves_nothing():
    """Layers with no copy of ours (all oneDNN) or less than a huge page of them: no region."""
    model = nn.Sequential(nn.Linear(16, 16))
    pack_linear_layers(model)
    assert cpu_linear.move_to_huge_pages(model) == 0


@pytest.mark.parametrize(
    ("vendor", "family", "flags", "zen4"),
    [
        ("AuthenticAMD", "25", "fma avx2 avx512f avx512bw", True),  # Zen 4 (Genoa)
        ("AuthenticAMD", "25", "fma avx2", False),  # Zen 3
        ("AuthenticAMD", "26", "fma avx2 avx512f avx512bw", False),  # Zen 5
        ("GenuineIntel", "6", "fma avx2 avx512f avx512bw amx_tile", False),  # Sapphire Rapids
    ],
)
def test_zen4_is_told_apart_by_vendor_family_and_avx512(vendor, family, flags, zen4):
    block = (
        f"processor\t: {{}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nflags\t\t: {flags}\n"
    )
    assert (
        cpuinfo.fields_are_amd_zen4(
            cpuinfo.cpuinfo_fields(block.format(0) + "\n" + block.format(1))
        )
        == zen4
    )


def test_linear_benchmark_times_the_engines_fp32_kernels_on_its_pages():
    """``benchmarks.fp32_linear``: every layer shape through llmserve's GEMM in both orders
    beside F.linear, its packed copies in huge pages as the engine moves them (equal to the
    originals) or on plain pages."""
    from llmserve.benchmarks import fp32_linear

    packed = [cpu_kernels.linear_f32_pack(torch.randn(2048, 512)) for _ in range(3)]  # 12 MiB
    moved = fp32_linear._in_huge_pages(packed)
    assert all(torch.equal(a, b) for a, b in zip(moved, packed, strict=True))
    if hasattr(mmap, "MADV_HUGEPAGE"):  # one region of huge pages, the copies one by one
        assert moved[0].data_ptr() != packed[0].data_ptr()
        assert moved[1].data_ptr() - moved[0].data_ptr() == packed[0].nbytes
    for huge in (True, False):
        results = fp32_linear.measure([3], layers=2, budget_s=0.0, huge_pages=huge)
        kernels = {r["kernel"] for r in results}
        assert {"llmserve linear_f32", "llmserve whole panels", "F.linear"} <= kernels
        assert len(results) == 5 * len(kernels)  # SmolLM2's five shapes
        assert all(r["us"] > 0 and r["gflops"] > 0 for r in results)

"""Kernel tests run Triton on CPU through its interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (Triton reads it when a
kernel is decorated); llmserve.kernels imports its kernel modules lazily, so setting it here
is early enough even if Triton itself was already imported.

On a GPU machine, ``LLMSERVE_KERNEL_TEST_DEVICE=cuda pytest tests/kernels`` compiles the
Triton kernels for the GPU instead and runs every test that takes the ``kernels`` fixture
with CUDA as torch's default device (the C++ CPU kernel tests stay on the CPU).
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("LLMSERVE_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from llmserve.kernels import cpu as cpu_kernels  # noqa: E402  (after TRITON_INTERPRET)


@pytest.fixture(autouse=True)
def _seeded():
    """Same random inputs on every run, so a failure reproduces."""
    import torch

    torch.manual_seed(0)


@pytest.fixture
def kernels():
    """The llmserve.kernels package, skipping the test when Triton is not installed."""
    pytest.importorskip("triton")
    import llmserve.kernels as kernels

    assert kernels.is_triton_available()
    if DEVICE == "cpu":
        yield kernels
        return
    import torch

    torch.set_default_device(DEVICE)
    try:
        yield kernels
    finally:
        torch.set_default_device(None)


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request):
    """Each instruction-set path of the C++ CPU kernels in turn, skipping those this CPU
    lacks (CI on an AVX2-only host still runs the AVX2 and scalar ones, and avx2_w16: the
    AVX-512 code's shape on AVX2 instructions)."""
    assert cpu_kernels.available(), "the C++ CPU kernels failed to build (see the log)"
    if request.param not in cpu_kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    with cpu_kernels.forced_isa(request.param) as chosen:
        assert chosen == request.param
        yield chosen

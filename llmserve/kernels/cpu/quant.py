"""Fused dequantize-matmul C++ kernels for ``QuantizedWeight`` (quantization/layout.py).

    quant_gemm.cpp   the ops: activations quantized to int8 per block of 32 columns (absmax),
                     integer dot products with the 4/8-bit weight values, one float scale per
                     block and weight group (llama.cpp's scheme); or to two int8 digits per
                     value (int8x2: 15 bits per block, two dots per weight vector)
    quant_gemm.h     the AVX-512 VNNI and AVX2 tiles
    quant_activations.h  x quantized per block: natural order, or the tiles' pair layout (SIMD)
    quant_float.cpp  quant_linear_f32: float activations, weights decoded in registers
                     (AVX-512 / AVX2 / portable, chosen at run time); tiles of 64 rows decoded
                     to an L2-sized buffer and multiplied by ATen's GEMM for M >= 16. Exact up
                     to summation order: the engine's default CPU path
    quant_float_gemv_impl.h  its decode-shape kernels (AVX-512, AVX2)
    quant_bindings.cpp  the ops of quant_ops.h registered with torch and bound for Python

Unlike the kernels in ``__init__.py`` this extension is built for the baseline x86-64 target
(no ``-march=native``): the SIMD code carries per-function target attributes and the path is
picked at run time from the CPU's features, so one cached build is safe on any host. ``isa``
arguments take ``"auto"`` (the best this CPU runs; ``auto_isa()`` says which),
``"avx512_vnni"``, ``"avx2"`` or ``"scalar"``; forcing one the CPU lacks raises.

Built on first use (20 s on a 2-core AVX2 Zen 3 host), cached by torch under
``TORCH_EXTENSIONS_DIR``.
Without a C++ compiler, or with ``LLMSERVE_CPU_KERNELS=0``, ``available()`` is False.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from llmserve.cpuinfo import cpu_flags
from llmserve.kernels.cpu.build import NativeLibrary
from llmserve.quantization.layout import QuantizedWeight

_HERE = Path(__file__).parent
ISAS = ("avx512_vnni", "avx2", "scalar")
# no -march: ISA-specific functions have target attributes and are chosen at run time
LIBRARY = NativeLibrary(
    name="llmserve_cpu_quant",
    namespace="llmserve_quant",
    sources=[_HERE / n for n in ("quant_gemm.cpp", "quant_float.cpp", "quant_bindings.cpp")],
    headers=[
        _HERE / n
        for n in (
            "aten.h",
            "quant_ops.h",
            "bindings.h",
            "quant_gemm.h",
            "quant_activations.h",
            "quant_float_gemv_impl.h",
        )
    ],
    cflags=[],
    probe_ops=("quant_linear", "quant_linear_f32"),
)


def available() -> bool:
    """Whether the kernels are built and loaded (builds them on the first call)."""
    return LIBRARY.available()


def _ops():
    return LIBRARY.ops()


def auto_isa() -> str:
    """The path ``isa="auto"`` runs on this CPU: ``avx512_vnni``, ``avx2`` or ``scalar``."""
    return _ops().resolve_isa("auto")


def supported_isas() -> list[str]:
    """Every ``isa`` this CPU can run, best first."""
    ops = _ops()
    supported = []
    for isa in ISAS:
        try:
            supported.append(ops.resolve_isa(isa))
        except RuntimeError:
            pass
    return supported


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x [M, K]`` -> ``(xq int8 [M, K], xs fp32 [M, K / 32])``: per block of 32 columns,
    ``xs = absmax / 127`` and ``xq = round(x / xs)`` (half to even), so ``x ~= xq * xs``."""
    return _ops().quantize_activations(x)


def quant_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    """``y [M, N] = (xq * xs) @ W^T + bias`` from already-quantized activations: ``xq`` int8
    ``[M, K]`` in [-127, 127] and ``xs`` fp32 ``[M, K / 32]`` (a per-row scale repeated per
    block is fine). Columns are in the stored order (``weight.perm`` is not applied); the
    ``mins`` term uses ``xs * sum(xq)`` as each group's activation sum."""
    return _ops().quant_gemm(
        xq, xs, weight.qweight, weight.scales, weight.mins, weight.lut,
        weight.bits, weight.group_size, bias, isa,
    )  # fmt: skip


def quant_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    isa: str = "auto",
    act_digits: int = 1,
) -> torch.Tensor:
    """fp32 ``x [..., K]`` -> ``[..., N]``, the fused path of ``reference_linear``: one C++ call
    that gathers ``x[..., perm]`` (act-order), quantizes per 32-block and runs the integer GEMM.
    ``act_digits=2`` ("int8x2") keeps two int8 digits per activation, ``x = xs * (hi + lo / 128)``:
    an error of ``xs / 256`` instead of ``xs / 2`` for twice the integer dot products.
    The ``mins`` term uses the exact float sum of ``x`` over each group."""
    return LIBRARY.direct().quant_linear(
        x, weight.qweight, weight.scales, weight.mins, weight.lut, weight.perm,
        weight.bits, weight.group_size, bias, isa, act_digits,
    )  # fmt: skip


def has_bf16_gemm() -> bool:
    """Whether ``bf16_gemm=True`` takes the bf16 path here (the CPU has AVX512_BF16)."""
    return {"avx512_bf16", "avx512bw"} <= cpu_flags()


def float_decodes_faster() -> bool:
    """Whether "auto" multiplies decode-sized batches with the float kernel: on AVX-512 CPUs,
    where its 16-lane decode streams the weights faster than the integer kernel (measured on
    AMD Zen 5: 3.6 vs 4.2 ms for the default model's Q4_1 layers per token, 0.53 vs 0.74 ms for
    its Q8_0 LM head; batch-1 decode 139 vs 122 tok/s); on AVX2 the integer kernel is faster
    (4.5 vs 5.0, 0.65 vs 1.17 ms). Code-book weights (NF4, FP4) keep the integer kernel: their
    lut gather costs the float kernel more (124 vs 114 tok/s with int8x2 on NF4)."""
    return {"avx512f", "avx512bw"} <= cpu_flags()


DECODE_ROWS = 16  # below this many rows "auto" takes the decode-shaped kernel

MODES = ("auto", "float", "int8x2", "int8")


def linear_function(mode: str) -> Callable[..., torch.Tensor]:
    """The engine's ``(x, weight, bias) -> y`` with the ops looked up once (they run ~120 times
    a decode step). ``mode``:

        float   the float-activation kernel at every batch size (exact up to summation order)
        int8x2  two-digit int8 activations at every batch size (about 1e-4 relative error)
        int8    one-digit int8 activations (llama.cpp's scheme)
        auto    below DECODE_ROWS rows, where the weights' bytes decide: the float kernel on
                AVX-512 CPUs (but int8x2 for NF4/FP4), int8x2 on the others
                (``float_decodes_faster``); above, the
                decode-then-GEMM float path, in bf16 tiles on CPUs with AVX512_BF16 (oneDNN's
                AMX/BF16 GEMM), where compute decides
    """
    direct = LIBRARY.direct()  # pybind11 calls: no dispatcher on the per-layer path
    f32, integer = direct.quant_linear_f32, direct.quant_linear

    def float_linear(x, w, bias=None, bf16_gemm=False):
        return f32(
            x, w.qweight, w.scales, w.mins, w.lut, w.perm, w.bits, w.group_size, bias, "auto",
            bf16_gemm,
        )  # fmt: skip

    def integer_linear(x, w, bias=None, act_digits=2):
        return integer(
            x, w.qweight, w.scales, w.mins, w.lut, w.perm, w.bits, w.group_size, bias, "auto",
            act_digits,
        )  # fmt: skip

    if mode == "float":
        return float_linear
    if mode in ("int8", "int8x2"):
        digits = 1 if mode == "int8" else 2
        return lambda x, w, bias=None: integer_linear(x, w, bias, digits)
    assert mode == "auto", mode

    float_decode = float_decodes_faster()

    def auto_linear(x, w, bias=None):
        if x.shape[0] >= DECODE_ROWS:
            return float_linear(x, w, bias, bf16_gemm=True)
        if float_decode and w.lut is None:
            return float_linear(x, w, bias)
        return integer_linear(x, w, bias, 2)

    return auto_linear


def quant_linear_f32(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    isa: str = "auto",
    bf16_gemm: bool = False,
) -> torch.Tensor:
    """fp32 ``x [M, K]`` -> ``[M, N]`` with float activations (no activation rounding): the
    weights are decoded in registers and multiplied in fp32; ``perm`` is applied inside.
    ``bf16_gemm``: from 16 rows on, tiles of the weight decoded to bf16 and multiplied by
    ATen's bf16 GEMM (on CPUs with AVX512_BF16; elsewhere the fp32 path runs)."""
    return LIBRARY.direct().quant_linear_f32(
        x, weight.qweight, weight.scales, weight.mins, weight.lut, weight.perm,
        weight.bits, weight.group_size, bias, isa, bf16_gemm,
    )  # fmt: skip

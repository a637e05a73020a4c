"""Native CPU kernels (C++), compiled on first use with torch's extension builder.

    paged_attention.cpp   paged_decode_attention: decode attention reading K/V in place
                          from the paged pool (bodies: paged_attention_impl.h, its work items;
                          attention_chunk_impl.h, the online softmax; attention_scores_impl.h,
                          q . k on either K layout); decode_attention: a decode-only step's K/V
                          write and attention in one call; paged_attention: the same for any
                          step (prompt chunks, causal); each takes a sliding window
    kernels_bindings.cpp  every function of kernels_ops.h registered as a torch op and bound
                          directly for Python (``_direct()``: no dispatcher on the per-layer
                          path, the GIL released as each runs: bindings.h); the kernel files
                          include only aten.h, a slice of ATen, and compile in half the time
    fused.cpp             rms_norm, fused_add_rms_norm_, silu_and_mul, gelu_tanh_and_mul,
                          rotary_interleaved, rotary_neox: one pass over memory each;
                          argmax_rows and draw_rows, greedy and temperature sampling from the
                          logits (body: fused_impl.h)
    gemm.cpp              linear_f32_pack, linear_f32: the fp32 linear on a weight packed at
                          load, streamed front to back (body: gemm_impl.h)
    gemm_bf16.cpp         linear_bf16_pack, linear_bf16: the same for bf16 with vdpbf16ps
                          or fp32 FMAs on widened values (``widen``), AVX512_BF16 only
                          (``has_bf16_gemm``)
    gemm_amx.cpp          linear_bf16_amx: the bf16 linear by AMX tiles on linear_bf16_pack's
                          weight (Intel Sapphire Rapids and later: ``has_amx_gemm``), or its
                          tile instructions emulated in C++ (``emulate``, any host: tests)
    threads.cpp           bind_threads: the calling thread and torch's OpenMP workers pinned
                          one per CPU (llmserve/runner/cpu_threads.py decides which)

All take float32 or bfloat16 tensors (bf16 is widened to fp32 in registers, accumulated in
fp32, rounded once when stored; the attention's KV pools may also be narrower: bf16 under fp32,
fp8, fp8.h) and are threaded with torch's intra-op pool; the GEMM and the
attention hand out their work in chunks that threads take as they come free (parallel.h), so
a thread the OS preempts does not hold the others at the barrier. The library is built for
the baseline x86-64 target; every body is compiled for AVX-512, AVX2 and plain C++
(isa.h, vec.h) and the path is chosen at run time: the best this CPU runs (``avx512`` rather
than ``avx512_bf16`` where ``widens_bf16``), or the one named by ``LLMSERVE_CPU_ISA``
(``avx512_bf16``, ``avx512``, ``avx2``, ``scalar``) or ``set_isa`` (tests force each one);
``avx512_bf16`` is the AVX-512 code plus vdpbf16ps for bf16 attention scores.
``avx2_w16`` is for tests only, never chosen on its own: the AVX-512 code's 16-lane shape (its
register tiles, head groups and tails) built from pairs of AVX2 vectors, so an AVX2-only host
checks the logic that AVX-512 hosts run.

The build (``build.py``, about a minute on 2 cores) runs once per machine, cached by torch
(``TORCH_EXTENSIONS_DIR``); one build is safe on any x86-64 host. Without a C++ compiler, or
with ``LLMSERVE_CPU_KERNELS=0``, ``available()`` is False and callers keep their torch path.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from llmserve.kernels.cpu.build import NativeLibrary

_HERE = Path(__file__).parent
ISAS = ("avx512_bf16", "avx512", "avx2", "avx2_w16", "scalar")
# no -march: the ISA-specific copies carry target pragmas and are chosen at run time
LIBRARY = NativeLibrary(
    name="llmserve_cpu_kernels",
    namespace="llmserve_cpu",
    sources=[
        _HERE / n
        for n in (
            "paged_attention.cpp",
            "fused.cpp",
            "gemm.cpp",
            "gemm_bf16.cpp",
            "gemm_amx.cpp",
            "threads.cpp",
            "kernels_bindings.cpp",
        )
    ],
    headers=[
        _HERE / n
        for n in (
            "aten.h",
            "kernels_ops.h",
            "bindings.h",
            "vec.h",
            "fp8.h",
            "isa.h",
            "parallel.h",
            "per_isa.h",
            "linear_io.h",
            "prefetch_impl.h",
            "paged_attention_impl.h",
            "attention_scores_impl.h",
            "attention_chunk_impl.h",
            "fused_impl.h",
            "gemm_impl.h",
        )
    ],
    cflags=[],
    probe_ops=("silu_and_mul", "set_isa"),
)


def available() -> bool:
    """Whether the native kernels are built and loaded (builds them on the first call)."""
    return LIBRARY.available()


def _ops():
    """The registered ops, building them first if needed."""
    return LIBRARY.ops()


def _direct():
    """The same functions bound directly (no dispatcher): the per-call wrappers below."""
    return LIBRARY.direct()


def current_isa() -> str:
    """The path the kernels take now: ``avx512_bf16``, ``avx512``, ``avx2`` or ``scalar``."""
    return _ops().set_isa("")


def amd_family() -> int:
    """This CPU's family as the kernels read it from cpuid, where the vendor is AMD (25: Zen
    3 and 4, 26: Zen 5); 0 elsewhere. Some kernels choose how they prefetch by it."""
    return _direct().amd_family()


def widens_bf16() -> bool:
    """Whether bf16 products run faster here as fp32 FMAs on widened values than by
    vdpbf16ps (isa.h: Intel CPUs with AVX512_BF16 and no AMX): ``auto`` then takes the
    ``avx512`` path over ``avx512_bf16``, and ``PackedLinear`` calls ``linear_bf16`` with
    ``widen`` for its bf16 layers."""
    return _direct().widens_bf16()


def supported_isas() -> list[str]:
    """Every path this CPU can run, best first (``avx2_w16``, a test path, after ``avx2``)."""
    current, supported = current_isa(), []
    for isa in ISAS:
        try:
            supported.append(_ops().set_isa(isa))
        except RuntimeError:
            pass
    _ops().set_isa(current)
    return supported


@contextlib.contextmanager
def forced_isa(isa: str) -> Iterator[str]:
    """Run the kernels on ``isa`` (``auto``, ``avx512_bf16``, ``avx512``, ``avx2``,
    ``scalar``) inside the block; raises RuntimeError when this CPU lacks it. Process-wide:
    for tests and benchmarks."""
    previous = current_isa()
    chosen = _ops().set_isa(isa)
    try:
        yield chosen
    finally:
        _ops().set_isa(previous)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension; a float32 weight stays
    float32 (bf16 rows times fp32 weights, rounded once: Gemma's ``1 + w``)."""
    if weight.dtype != torch.float32:
        weight = weight.to(x.dtype)
    return _direct().rms_norm(x, weight, eps)


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``; returns ``(x, residual)``."""
    _direct().fused_add_rms_norm_(x, residual, weight.to(x.dtype), eps)
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2d] -> silu(x[..., :d]) * x[..., d:]``."""
    return _direct().silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2d] -> gelu_tanh(x[..., :d]) * x[..., d:]`` (GeGLU with GELU's tanh form)."""
    return _direct().gelu_tanh_and_mul(x)


def rotary_neox(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
) -> torch.Tensor:
    """NeoX's rotary on ``x [T, heads * head_dim]`` (rows may be strided): in each head, the
    pairs (x[i], x[i + rotary_dim / 2]) rotated by the angle i of ``positions[t]`` (``cos``,
    ``sin [max_positions, rotary_dim / 2]``, fp32 or bf16), later channels copied -> a new
    ``[T, heads * head_dim]`` tensor."""
    return _direct().rotary_neox(x, positions, cos, sin, head_dim, rotary_dim)


def rotary_interleaved(
    x: torch.Tensor, positions: torch.Tensor, cis: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """``x: [T, heads * D]`` (rows may be strided), pairs ``(x[2i], x[2i+1])`` of each head
    rotated by ``cis[position]`` (``[max_pos, D/2, 2]`` cos/sin) -> a new contiguous tensor."""
    return _direct().rotary_interleaved(x, positions, cis, head_dim)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [rows, n]`` (n > 0) -> int64 ``[rows]``: each row's first index of its largest value
    (a NaN counts as the largest), as ``x.max(dim=-1).indices``."""
    return _direct().argmax_rows(x)


def draw_rows(
    x: torch.Tensor,
    inv_temperature: torch.Tensor,
    u: torch.Tensor,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [rows, n]`` logits -> int64 ``[rows]``: row r's draw from ``softmax(x[r] *
    inv_temperature[r])`` at the uniform ``u[r]`` in [0, 1) (the first token whose cumulative
    probability passes it), after its ``top_p`` (< 1: the nucleus, found by a histogram of
    the weights, no sort) and ``min_p`` (> 0), with no copy of the logits; -inf logits are
    never drawn. The others are float32 ``[rows]``; top_p None is 1, min_p None is 0."""
    if top_p is None:
        top_p = torch.ones_like(u)
    if min_p is None:
        min_p = torch.zeros_like(u)
    return _direct().draw_rows(x, inv_temperature, u, top_p, min_p)


def linear_f32_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out_features, in_features] (float32) packed for ``linear_f32``."""
    return _direct().linear_f32_pack(weight.detach().contiguous())


def linear_f32(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    whole_panels: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for float32 ``x`` [..., in_features] and a packed weight.
    ``whole_panels``: up to 256 rows take each 48-column panel of the weight over all of K, tile
    by tile, instead of slice by slice (gemm_impl.h's gemm_panels_whole; the same result)."""
    return _direct().linear_f32(x, packed, out_features, bias, whole_panels)


@functools.cache
def has_bf16_gemm() -> bool:
    """Whether ``linear_bf16`` runs here: the kernels built and the CPU has AVX512_BF16
    (asked once: ``supported_isas`` switches the process-wide path while it probes)."""
    return available() and "avx512_bf16" in supported_isas()


def linear_bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out_features, in_features] (bfloat16, even in_features) packed for
    ``linear_bf16``."""
    return _direct().linear_bf16_pack(weight.detach().contiguous())


def linear_bf16(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    widen: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for bfloat16 ``x`` [..., in_features] and a packed weight:
    fp32 sums, rounded to bf16 once (AVX512_BF16 only). ``widen``: the products by fp32 FMAs
    on the values widened in registers instead of by vdpbf16ps (for CPUs where that runs
    slower; the sums in order over k, as the fp32 GEMM's)."""
    return _direct().linear_bf16(x, packed, out_features, bias, widen)


@functools.cache
def has_amx_gemm() -> bool:
    """Whether ``linear_bf16_amx`` runs here: the kernels built, the CPU has AMX-TILE,
    AMX-BF16 and AVX512_BF16, and Linux granted this process the tiles' state."""
    return available() and bool(_direct().amx_ready())


def linear_bf16_amx(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    emulate: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for bfloat16 ``x`` [..., in_features] (a multiple of 32) and
    a weight packed by ``linear_bf16_pack``, by AMX tiles (tdpbf16ps): fp32 sums, rounded to
    bf16 once. ``emulate``: the same kernel with each tile instruction done in plain C++ (any
    host; slow: for tests)."""
    return _direct().linear_bf16_amx(x, packed, out_features, bias, emulate)


def bind_threads(cpus: list[int]) -> int:
    """Pin the calling thread to ``cpus[0]`` and torch's OpenMP worker i (the pool this thread's
    parallel regions use) to ``cpus[i]``; returns how many were pinned (``len(cpus)`` when all
    were). ``len(cpus)`` should be ``torch.get_num_threads()``."""
    return _direct().bind_threads([int(c) for c in cpus])


# the attention wrappers (attention.py), here with the rest of the library's functions
from llmserve.kernels.cpu.attention import (  # noqa: E402, F401
    PROMPT_SDPA_MIN_ROWS,
    decode_attention,
    paged_attention,
    paged_decode_attention,
    prompt_sdpa_min_rows,
)

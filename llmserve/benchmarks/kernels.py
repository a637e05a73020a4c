"""Quantized CPU matmul kernels against fp32 and torch's own weight-only baselines.

For each linear shape of SmolLM2-135M, at decode (M = 1), batched decode (M = 64, the
text2sql batch) and prefill (M = 256) rows:

    fp32              F.linear on the fp32 weight
    torch int8/ch     torch._weight_int8pack_mm (int8 per-channel weights)
    torch int4 g32    aten._weight_int4pack_mm_for_cpu (4-bit, group 32, scale + zero; and
                      group 128 where K allows)
    ours q8_0         llmserve quant_linear (int8 activations), 8-bit, G = 32 (GGUF Q8_0)
    ours int8/ch      llmserve quant_linear (int8 activations), 8-bit, G = K (per channel)
    ours q4_1         llmserve quant_linear (int8 activations), 4-bit, G = 32 with mins (Q4_1)
    ours q4 g128      llmserve quant_linear (int8 activations), 4-bit, G = 128 with mins
                      (GPTQ-like; K % 128 == 0)
    x2 q8_0, x2 q4_1  llmserve quant_linear with two-digit activations (int8x2: 15 bits per
                      block of 32, two integer dots per weight vector)
    f32 q8_0, f32 q4_1  llmserve quant_linear_f32 (float activations, weights decoded to fp32)

Reported per call: microseconds, and GB/s of weight bytes (weights plus scales/mins) read,
the figure that matters at decode, where a matmul streams its weights once. Weights and
activations are random: the kernels' cost does not depend on the values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch.nn import functional as F

from llmserve.quantization.layout import QuantizedWeight, pack_int4

# (layer, N, K) of SmolLM2-135M: fused q/k/v (576 + 192 + 192), o, fused gate/up, down, LM head
SMOLLM2_SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]
BATCH_ROWS = {"decode": 1, "batch": 64, "prefill": 256}


def _time_us(fn: Callable[[], torch.Tensor], repeats: int, budget_s: float = 0.3) -> float:
    """Median microseconds per call after a timed warm-up call; fewer repeats for slow calls
    (a call slower than the budget is timed once: the warm-up)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first > budget_s:
        return first * 1e6
    repeats = max(3, min(repeats, int(budget_s / max(first, 1e-9))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2] * 1e6


def _random_quantized(n: int, k: int, bits: int, group_size: int, mins: bool) -> QuantizedWeight:
    if bits == 8:
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    else:
        qweight = pack_int4(torch.randint(0, 16, (n, k)))
    scales = torch.rand(n, k // group_size) * 0.01
    return QuantizedWeight(
        bits, qweight, scales, torch.randn_like(scales) * 0.01 if mins else None, group_size
    )


def _torch_int4(n: int, k: int, group_size: int) -> tuple[Callable, int]:
    """(x -> y, weight bytes) for torch's CPU int4 kernel; scale_and_zeros is [K/G, N, 2]."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)  # uint8 [N, K/2]
    scale_and_zeros = torch.rand(k // group_size, n, 2) * 0.01
    nbytes = packed.numel() + scale_and_zeros.numel() * 4

    def call(x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_and_zeros)

    return call, nbytes


def _kernels(n: int, k: int, isa: str) -> dict[str, tuple[Callable, int]]:
    """Every kernel of the table for one shape: name -> (x -> y, weight bytes)."""
    from llmserve.kernels.cpu import quant

    w32 = torch.randn(n, k) * 0.02
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n) * 0.01
    kernels = {
        "fp32": (lambda x: F.linear(x, w32), w32.numel() * 4),
        "torch int8/ch": (lambda x: torch._weight_int8pack_mm(x, w8, s8), w8.numel() + n * 4),
        "torch int4 g32": _torch_int4(n, k, 32),
    }
    ours = {
        "ours q8_0": (8, 32, False),
        "ours int8/ch": (8, k, False),
        "ours q4_1": (4, 32, True),
    }
    if k % 128 == 0:  # group 128 needs K divisible by it (SmolLM2: only the down projection)
        kernels["torch int4 g128"] = _torch_int4(n, k, 128)
        ours["ours q4 g128"] = (4, 128, True)
    if not quant.available():
        return kernels
    for name, (bits, group_size, mins) in ours.items():
        weight = _random_quantized(n, k, bits, group_size, mins)
        kernels[name] = (lambda x, w=weight: quant.quant_linear(x, w, isa=isa), weight.nbytes)
    for name, (bits, mins) in {"x2 q8_0": (8, False), "x2 q4_1": (4, True)}.items():
        weight = _random_quantized(n, k, bits, 32, mins)
        kernels[name] = (
            lambda x, w=weight: quant.quant_linear(x, w, isa=isa, act_digits=2),
            weight.nbytes,
        )
    f32_isa = {"avx512_vnni": "avx512"}.get(isa, isa)  # the float kernel needs no VNNI
    for name, (bits, mins) in {"f32 q8_0": (8, False), "f32 q4_1": (4, True)}.items():
        weight = _random_quantized(n, k, bits, 32, mins)
        kernels[name] = (
            lambda x, w=weight: quant.quant_linear_f32(x, w, isa=f32_isa),
            weight.nbytes,
        )
    return kernels


def run_kernel_benchmark(
    shapes: Sequence[tuple[str, int, int]] | None = None, repeats: int = 50, isa: str = "auto"
) -> list[dict]:
    """Time every kernel on every ``(layer, N, K)`` shape at decode and prefill batch rows.

    Returns one dict per (phase, layer, kernel): ``phase, layer, m, n, k, kernel, us, gbps``.
    """
    rows = []
    for layer, n, k in shapes or SMOLLM2_SHAPES:
        kernels = _kernels(n, k, isa)
        for phase, m in BATCH_ROWS.items():
            x = torch.randn(m, k)
            for name, (fn, nbytes) in kernels.items():
                us = _time_us(lambda fn=fn, x=x: fn(x), repeats)
                rows.append(
                    {"phase": phase, "layer": layer, "m": m, "n": n, "k": k, "kernel": name,
                     "us": us, "gbps": nbytes / us / 1e3}
                )  # fmt: skip
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per (phase, layer), one column per kernel, ``us (GB/s)`` in cells."""
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    lines: dict[tuple, dict[str, str]] = {}
    for r in rows:
        key = (r["phase"], r["m"], r["layer"], f"{r['n']}x{r['k']}")
        lines.setdefault(key, {})[r["kernel"]] = f"{r['us']:.0f} ({r['gbps']:.1f})"
    header = ["phase", "M", "layer", "N x K", *kernels]
    out = ["| " + " | ".join(header) + " |", "|---|---:|---|---|" + "---:|" * len(kernels)]
    for key, cells in lines.items():
        values = [str(v) for v in key] + [cells.get(name, "-") for name in kernels]
        out.append("| " + " | ".join(values) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(format_table(run_kernel_benchmark()))

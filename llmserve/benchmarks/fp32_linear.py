"""``python -m llmserve.benchmarks.fp32_linear``: the CPU linears, llmserve's GEMM
(kernels/cpu/gemm.cpp, in both orders of a decode-sized call: slice by slice, and panel by
panel with ``whole_panels``; with ``--dtype bfloat16`` gemm_bf16.cpp, where the CPU has
AVX512_BF16, and gemm_amx.cpp, where it has AMX) against oneDNN's packed weight and
``F.linear``.

For each linear shape of SmolLM2-135M at M rows (1: batch-1 decode, 64: a decode batch, 2048:
a prompt chunk), copies of the weight are cycled, as the layers of a forward pass are, so that
they come from DRAM, not the caches: that is the case a decode step meets (its weights and K/V
together are several times any last-level cache), and where the kernels differ. By default
as many copies as fill twice the last-level cache, at least 30 (an Intel Xeon VM measured
here has a 260 MB L3, where 30 copies of the q|k|v, o or down weight, 40-106 MB in fp32, all
fit); ``--layers`` sets the count. llmserve's packed copies lie in transparent huge pages as
the engine puts them (``cpu_linear.move_to_huge_pages``; ``--pages 4k`` leaves them on plain
pages; oneDNN's opaque copies stay there in both). Each (layer, M) is timed ``--rounds`` times,
the kernels taking turns (this kind of VM drifts by 10-20% within minutes); reported per call,
the median round: microseconds and GFLOP/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from llmserve.benchmarks.kernels import SMOLLM2_SHAPES
from llmserve.cpuinfo import last_level_cache_bytes
from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers import cpu_linear
from llmserve.memory import HugePageArena


def _in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` in one region of transparent huge pages (as the engine moves its
    packed weights), or ``tensors`` themselves where Linux gives none."""
    arena = HugePageArena(tensors)
    return [arena.copy(t) for t in tensors] if arena.nbytes else tensors


def _kernels(weights: list[torch.Tensor], huge_pages: bool = True) -> dict[str, tuple]:
    """name -> (x, packed weight -> y, the packed weights)"""
    place = _in_huge_pages if huge_pages else list
    kernels = {"F.linear": (F.linear, weights)}
    bf16 = weights[0].dtype == torch.bfloat16
    if torch.backends.mkldnn.is_available() and (not bf16 or cpu_linear.has_native_bf16()):
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        kernels["oneDNN packed"] = (
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            onednn,
        )
    n = weights[0].shape[0]
    if bf16 and cpu_kernels.has_bf16_gemm():
        ours = place([cpu_kernels.linear_bf16_pack(w) for w in weights])
        kernels["llmserve linear_bf16"] = (lambda x, w: cpu_kernels.linear_bf16(x, w, n), ours)
        kernels["llmserve widened"] = (  # fp32 FMAs: the order PackedLinear uses on Intel
            lambda x, w: cpu_kernels.linear_bf16(x, w, n, widen=True),  # without AMX
            ours,
        )
        k = weights[0].shape[1]
        if cpu_kernels.has_amx_gemm() and k % 32 == 0:  # AMX tiles (LLMSERVE_CPU_AMX_GEMM=1)
            kernels["llmserve AMX"] = (
                lambda x, w: cpu_kernels.linear_bf16_amx(x, w, n),
                ours,
            )
    elif not bf16 and cpu_kernels.available():
        ours = place([cpu_kernels.linear_f32_pack(w) for w in weights])
        kernels["llmserve linear_f32"] = (lambda x, w: cpu_kernels.linear_f32(x, w, n), ours)
        kernels["llmserve whole panels"] = (  # the order PackedLinear uses on Zen 4
            lambda x, w: cpu_kernels.linear_f32(x, w, n, whole_panels=True),
            ours,
        )
    return kernels


def _time_us(fn, x: torch.Tensor, packed: list, budget_s: float) -> float:
    """Microseconds per call, cycling the weight copies for about ``budget_s``."""
    for w in packed:  # warm-up: every copy once
        fn(x, w)
    rounds, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < budget_s or rounds < 2:
        for w in packed:
            fn(x, w)
        rounds += 1
        elapsed = time.perf_counter() - start
    return elapsed / (rounds * len(packed)) * 1e6


MIN_COPIES = 30  # the default model's layers
MAX_BYTES = 1 << 30  # of copies per kernel


def default_copies(weight_bytes: int) -> int:
    """Copies of a weight that fill twice the last-level cache, at least MIN_COPIES."""
    return max(MIN_COPIES, -(-2 * last_level_cache_bytes() // weight_bytes))


def measure(
    rows: list[int],
    layers: int | None,
    budget_s: float,
    dtype: torch.dtype = torch.float32,
    rounds: int = 1,
    huge_pages: bool = True,
) -> list[dict]:
    results = []
    for layer, n, k in SMOLLM2_SHAPES:
        size = n * k * dtype.itemsize
        copies = layers if layers is not None else default_copies(size)
        copies = max(2, min(copies, MAX_BYTES // size))
        weights = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(copies)]
        kernels = _kernels(weights, huge_pages)
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(rounds):  # the kernels take turns
                for name, (fn, packed) in kernels.items():
                    times[name].append(_time_us(fn, x, packed, budget_s))
            for name, us_list in times.items():
                us = statistics.median(us_list)
                results.append(
                    {"layer": layer, "m": m, "n": n, "k": k, "kernel": name, "us": us,
                     "gflops": 2 * m * n * k / us / 1e3}
                )  # fmt: skip
    return results


def format_table(results: list[dict]) -> str:
    """Markdown: one line per (M, layer), one column per kernel, ``GFLOP/s (us)`` in cells."""
    kernels = list(dict.fromkeys(r["kernel"] for r in results))
    lines: dict[tuple, dict[str, str]] = {}
    for r in sorted(results, key=lambda r: r["m"]):
        key = (r["m"], r["layer"], f"{r['n']}x{r['k']}")
        lines.setdefault(key, {})[r["kernel"]] = f"{r['gflops']:.0f} ({r['us']:.0f} us)"
    out = [
        "| M | layer | N x K | " + " | ".join(kernels) + " |",
        "|---:|---|---|" + "---:|" * len(kernels),
    ]
    for key, cells in lines.items():
        values = [str(v) for v in key] + [cells.get(k, "-") for k in kernels]
        out.append("| " + " | ".join(values) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 2048])
    parser.add_argument(
        "--layers", type=int, default=None,
        help="weight copies cycled (default: enough to fill twice the last-level cache)",
    )  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=1, help="turns per kernel (median)")
    parser.add_argument(
        "--pages", choices=["huge", "4k"], default="huge",
        help="llmserve's packed copies in transparent huge pages (as the engine) or plain ones",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    filled = 2 * last_level_cache_bytes() >> 20
    copies = f"{args.layers} weight copies" if args.layers else (
        f"weight copies filling {filled} MiB a shape (at least {MIN_COPIES}, at most "
        f"{MAX_BYTES >> 20} MiB)")  # fmt: skip
    isa = cpu_kernels.current_isa() if cpu_kernels.available() else "-"
    print(f"{args.dtype} linears, {torch.get_num_threads()} threads, {copies} ({args.pages} "
          f"pages for llmserve's), {args.rounds} rounds, llmserve ISA {isa}")  # fmt: skip
    huge = args.pages == "huge"
    print(format_table(measure(args.rows, args.layers, args.budget_s, dtype, args.rounds, huge)))


if __name__ == "__main__":
    main()

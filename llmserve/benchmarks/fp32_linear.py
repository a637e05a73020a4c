"""``python -m llmserve.benchmarks.fp32_linear``: the fp32 CPU linears, llmserve's GEMM
(kernels/cpu/gemm.cpp) against oneDNN's packed weight and ``F.linear``.

For each linear shape of SmolLM2-135M at M rows (1: batch-1 decode, 64: a decode batch, 2048:
a prompt chunk), ``--layers`` copies of the weight are cycled, as the 30 layers of a forward
pass are, so that at the default they come from DRAM, not the caches: that is the case a
decode step meets, and where the kernels differ. Reported per call: microseconds and GFLOP/s.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F

from llmserve.benchmarks.kernels import SMOLLM2_SHAPES
from llmserve.kernels import cpu as cpu_kernels


def _kernels(weights: list[torch.Tensor]) -> dict[str, tuple]:
    """name -> (x, packed weight -> y, the packed weights)"""
    kernels = {"F.linear": (F.linear, weights)}
    if torch.backends.mkldnn.is_available():
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        kernels["oneDNN packed"] = (
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            onednn,
        )
    if cpu_kernels.available():
        n = weights[0].shape[0]
        ours = [cpu_kernels.linear_f32_pack(w) for w in weights]
        kernels["llmserve linear_f32"] = (lambda x, w: cpu_kernels.linear_f32(x, w, n), ours)
    return kernels


def measure(rows: list[int], layers: int, budget_s: float) -> list[dict]:
    results = []
    for layer, n, k in SMOLLM2_SHAPES:
        copies = max(2, min(layers, (1 << 30) // (n * k * 4)))  # at most 1 GiB per kernel
        weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
        for name, (fn, packed) in _kernels(weights).items():
            for m in rows:
                x = torch.randn(m, k)
                for w in packed:  # warm-up: every copy once
                    fn(x, w)
                rounds, elapsed = 0, 0.0
                start = time.perf_counter()
                while elapsed < budget_s or rounds < 2:
                    for w in packed:
                        fn(x, w)
                    rounds += 1
                    elapsed = time.perf_counter() - start
                us = elapsed / (rounds * len(packed)) * 1e6
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
    parser.add_argument("--layers", type=int, default=30, help="weight copies cycled")
    parser.add_argument("--budget-s", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"fp32 linears, {torch.get_num_threads()} threads, {args.layers} weight copies, "
          f"llmserve ISA {cpu_kernels.current_isa() if cpu_kernels.available() else '-'}")  # fmt: skip
    print(format_table(measure(args.rows, args.layers, args.budget_s)))


if __name__ == "__main__":
    main()

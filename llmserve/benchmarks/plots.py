"""PNG plots of a sweep report (matplotlib, Agg backend: no display needed), kept small."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

FIGURE_DPI = 72


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_batch_sizes(points: Sequence[dict], path: str) -> str:
    """Output tokens/s (and mean sequences per step) against max_num_seqs, log2 x axis."""
    plt = _pyplot()
    sizes = [p["max_num_seqs"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(sizes, [p["output_throughput"] for p in points], "o-", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("batch size (max_num_seqs)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(
        sizes,
        [p["mean_seqs_per_step"] for p in points],
        "s--",
        color="gray",
        label="mean seqs/step",
    )
    twin.set_ylabel("mean sequences per step")
    ax.set_title("Offline throughput against batch size")
    _legend(ax, twin)
    return _save(fig, path)


def plot_request_rates(points: Sequence[dict], path: str) -> str:
    """Per strategy: TTFT, TPOT and E2E percentiles, and throughput, against request rate."""
    plt = _pyplot()
    rates = sorted({float(p["request_rate"]) for p in points})  # "inf" in a saved report
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), sharex=True)
    panels = [
        (axes[0][0], "ttft", "TTFT (ms)"),
        (axes[0][1], "tpot", "TPOT (ms)"),
        (axes[1][0], "e2el", "end-to-end latency (ms)"),
    ]
    for strategy in dict.fromkeys(p["batching"] for p in points):
        mine = {float(p["request_rate"]): p for p in points if p["batching"] == strategy}
        xs = [i for i, r in enumerate(rates) if r in mine]
        for ax, name, label in panels:
            line = ax.plot(
                xs, [_ms(mine[rates[i]], "median", name) for i in xs], "o-", label=f"{strategy} p50"
            )[0]
            ax.plot(
                xs,
                [_ms(mine[rates[i]], "p99", name) for i in xs],
                "x:",
                color=line.get_color(),
                label=f"{strategy} p99",
            )
            ax.set_ylabel(label)
        axes[1][1].plot(xs, [mine[rates[i]]["output_throughput"] for i in xs], "o-", label=strategy)
    axes[1][1].set_ylabel("output tokens/s")
    for ax in (axes[1][0], axes[1][1]):
        ax.set_xticks(range(len(rates)), [_rate_label(r) for r in rates])
        ax.set_xlabel("request rate (req/s, Poisson)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    axes[1][1].legend(fontsize=7)
    fig.suptitle("Latency and throughput against request rate (in-process engine)")
    return _save(fig, path)


def write_sweep_plots(report: dict, output_dir: str) -> list[str]:
    paths = []
    if report["batch_size_sweep"]:
        path = os.path.join(output_dir, "throughput_vs_batch_size.png")
        paths.append(plot_batch_sizes(report["batch_size_sweep"], path))
    if report["rate_sweep"]:
        path = os.path.join(output_dir, "latency_vs_request_rate.png")
        paths.append(plot_request_rates(report["rate_sweep"], path))
    return paths


def _ms(point: dict, stat: str, name: str) -> float:
    value = point.get(f"{stat}_{name}_ms")
    return math.nan if value is None else value


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _legend(*axes) -> None:
    handles, labels = [], []
    for ax in axes:
        h, label = ax.get_legend_handles_labels()
        handles += h
        labels += label
    axes[0].legend(handles, labels, fontsize=8, loc="upper left")


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

"""``llmserve bench sweep``: throughput against batch size, latency against request rate.

1. Batch size: for each --batch-sizes value B, a fresh engine with ``max_num_seqs=B`` runs the
   workload offline (all requests at once): output tokens/s against B.
2. Request rate: for each batching strategy (--strategies) and each --request-rates value, the
   workload arrives as a Poisson process at that rate. This runs *in process*: one loop adds
   each request to the engine at its arrival time and steps the engine in between, timing
   every token (no HTTP, no server; ``bench serve`` measures the server).

Writes ``sweep.json`` and two PNG plots into --output-dir.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from llmserve.benchmarks.engine_run import build_engine, drive
from llmserve.benchmarks.metrics import arrival_times, latency_result, throughput_result
from llmserve.benchmarks.report import format_table, machine_info, write_json
from llmserve.benchmarks.workloads import BenchRequest

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_REQUEST_RATES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
STRATEGIES = ("continuous", "dynamic", "static")


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    batch_sizes: Sequence[int]
    request_rates: Sequence[float]
    strategies: Sequence[str]
    temperature: float = 0.0
    seed: int = 0
    use_tqdm: bool = True


def sweep_batch_sizes(
    plan: SweepPlan, engine_kwargs: dict[str, Any], requests: Sequence[BenchRequest]
) -> list[dict]:
    """One offline run per batch size (``max_num_seqs``), each on a fresh engine."""
    points = []
    for batch_size in tqdm(plan.batch_sizes, desc="batch sizes", disable=not plan.use_tqdm):
        engine, load_s = build_engine(engine_kwargs | {"max_num_seqs": batch_size})
        records, elapsed, stats = drive(
            engine,
            requests,
            temperature=plan.temperature,
            desc=f"max_num_seqs={batch_size}",
            use_tqdm=plan.use_tqdm,
        )
        num_output = sum(r.output_len for r in records)
        point = throughput_result("llmserve", requests, elapsed, num_output) | stats
        points.append({"max_num_seqs": batch_size, "load_s": load_s} | point)
        del engine
    return points


def sweep_request_rates(
    plan: SweepPlan, engine_kwargs: dict[str, Any], requests: Sequence[BenchRequest]
) -> list[dict]:
    """Poisson arrivals at each rate, for each batching strategy (one engine per strategy)."""
    points = []
    for strategy in plan.strategies:
        engine, _ = build_engine(engine_kwargs | {"batching": strategy})
        for rate in tqdm(plan.request_rates, desc=f"rates ({strategy})", disable=not plan.use_tqdm):
            engine.reset_prefix_cache()  # every point starts cold, whatever ran before
            offsets = arrival_times(len(requests), rate, plan.seed)
            records, elapsed, stats = drive(
                engine,
                requests,
                offsets,
                plan.temperature,
                desc=f"{strategy} @ {rate:g} req/s",
                use_tqdm=plan.use_tqdm,
            )
            point = {"batching": strategy, "request_rate": rate}
            points.append(point | latency_result(records, elapsed) | stats)
        del engine
    return points


def run_sweep(
    plan: SweepPlan,
    engine_kwargs: dict[str, Any],
    requests: Sequence[BenchRequest],
    output_dir: str,
    output_json: str | None = None,
    workload: str = "",
) -> dict:
    """Both sweeps, the JSON report and the plots."""
    from llmserve.benchmarks import plots

    _validate(plan)
    report: dict[str, Any] = {
        "benchmark": "sweep",
        "workload": workload,
        "num_prompts": len(requests),
        "mean_prompt_len": sum(r.prompt_len for r in requests) / len(requests),
        "mean_output_len": sum(r.output_len for r in requests) / len(requests),
        "engine_args": engine_kwargs,
        "machine": machine_info(),
        "in_process": True,
        "batch_size_sweep": sweep_batch_sizes(plan, engine_kwargs, requests)
        if plan.batch_sizes
        else [],
        "rate_sweep": sweep_request_rates(plan, engine_kwargs, requests)
        if plan.request_rates
        else [],
    }
    os.makedirs(output_dir, exist_ok=True)
    report["plots"] = plots.write_sweep_plots(report, output_dir)
    print(sweep_summary_text(report))
    write_json(os.path.join(output_dir, "sweep.json"), report)
    if output_json:
        write_json(output_json, report)
    return report


def _validate(plan: SweepPlan) -> None:
    bad = [s for s in plan.strategies if s not in STRATEGIES]
    if bad:
        raise ValueError(f"unknown batching strategies {bad}; choose from {list(STRATEGIES)}")
    if any(b < 1 for b in plan.batch_sizes):
        raise ValueError(f"--batch-sizes must all be >= 1, got {list(plan.batch_sizes)}")
    if any(not r > 0 for r in plan.request_rates):
        raise ValueError(
            f"--request-rates must all be > 0 (or inf), got {list(plan.request_rates)}"
        )
    if not plan.batch_sizes and not plan.request_rates:
        raise ValueError("nothing to sweep: give --batch-sizes and/or --request-rates")


def sweep_summary_text(report: dict, markdown: bool = False) -> str:
    parts = []
    if report["batch_size_sweep"]:
        parts.append(_batch_size_table(report["batch_size_sweep"], markdown))
    if report["rate_sweep"]:
        parts.append(_rate_table(report["rate_sweep"], markdown))
    if report["plots"] and not markdown:
        parts.append("\n".join(f"plot: {path}" for path in report["plots"]))
    return "\n\n".join(parts)


def _batch_size_table(points: list[dict], markdown: bool) -> str:
    headers = ["max_num_seqs", "requests/s", "output tok/s", "seqs/step", "preemptions"]
    keys = ["max_num_seqs", "request_throughput", "output_throughput", "mean_seqs_per_step",
            "num_preemptions"]  # fmt: skip
    return format_table(headers, [[p[k] for k in keys] for p in points], markdown)


def _rate_table(points: list[dict], markdown: bool) -> str:
    headers = ["batching", "rate", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
               "E2E p50 ms", "E2E p99 ms"]  # fmt: skip
    keys = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "median_e2el_ms", "p99_e2el_ms"]  # fmt: skip
    rows = [[p["batching"], _rate(p["request_rate"])] + [p[k] for k in keys] for p in points]
    return format_table(headers, rows, markdown)


def _rate(rate: float | str) -> str:
    return f"{float(rate):g}"  # also reads "inf" from a saved report

"""What a benchmark reports: throughput of a whole run, latency percentiles per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from llmserve.benchmarks.workloads import BenchRequest

PERCENTILES = (50, 90, 99)


def throughput_result(
    backend: str, requests: Sequence[BenchRequest], elapsed_s: float, num_output_tokens: int
) -> dict:
    """Requests/s, output tokens/s and (prompt + output) tokens/s over ``elapsed_s``."""
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    elapsed_s = max(elapsed_s, 1e-9)
    return {
        "backend": backend,
        "num_requests": len(requests),
        "elapsed_s": elapsed_s,
        "total_prompt_tokens": num_prompt_tokens,
        "total_output_tokens": num_output_tokens,
        "request_throughput": len(requests) / elapsed_s,
        "output_throughput": num_output_tokens / elapsed_s,
        "total_token_throughput": (num_prompt_tokens + num_output_tokens) / elapsed_s,
    }


def summarize_ms(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``p90_<name>_ms``, ``p99_<name>_ms``."""
    values = np.asarray(values_s, dtype=float) * 1000.0
    if values.size == 0:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "p90", "p99")}
    p50, p90, p99 = np.percentile(values, PERCENTILES)
    return {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(p50),
        f"p90_{name}_ms": float(p90),
        f"p99_{name}_ms": float(p99),
    }


@dataclass
class RequestRecord:
    """Timings of one request, in seconds from its arrival (send time for HTTP)."""

    prompt_len: int
    output_len: int = 0  # output tokens actually received
    ttft: float | None = None  # first token
    e2e: float | None = None  # last token
    itls: list[float] = field(default_factory=list)  # gaps between consecutive chunks
    error: str | None = None

    @property
    def is_success(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


def latency_result(records: Sequence[RequestRecord], duration_s: float) -> dict:
    """Throughput over ``duration_s`` and TTFT/TPOT/ITL/E2E percentiles of the successful ones."""
    ok = [r for r in records if r.is_success]
    num_prompt = sum(r.prompt_len for r in ok)
    num_output = sum(r.output_len for r in ok)
    duration_s = max(duration_s, 1e-9)
    result: dict = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "total_prompt_tokens": num_prompt,
        "total_output_tokens": num_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": num_output / duration_s,
        "total_token_throughput": (num_prompt + num_output) / duration_s,
    }
    result |= summarize_ms("ttft", [r.ttft for r in ok])
    result |= summarize_ms("tpot", [r.tpot for r in ok if r.tpot is not None])
    result |= summarize_ms("itl", [gap for r in ok for gap in r.itls])
    result |= summarize_ms("e2el", [r.e2e for r in ok])
    return result


def arrival_times(num: int, request_rate: float, seed: int) -> list[float]:
    """Poisson arrivals: offsets (s), the first at 0, exponential gaps; rate inf: all at 0."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if np.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num)
    return ([0.0] + np.cumsum(gaps[:-1]).tolist()) if num else []

"""``llmserve bench report FILE.json ...``: saved results as Markdown, for docs/benchmarks.md.

The tables in the docs are pasted from this output, so every number there was measured.
"""

from __future__ import annotations

import json
import os


def render(report: dict, source: str, relative_to: str | None = None) -> str:
    """One saved report (throughput, serve or sweep) as a Markdown section."""
    from llmserve.benchmarks.report import machine_text
    from llmserve.benchmarks.serve_client import serve_summary_text
    from llmserve.benchmarks.sweep import sweep_summary_text
    from llmserve.benchmarks.throughput import summary_text

    kind = report.get("benchmark")
    renderers = {
        "throughput": summary_text,
        "serve": serve_summary_text,
        "sweep": sweep_summary_text,
    }
    if kind not in renderers:
        raise ValueError(f"{source}: not a saved bench report (benchmark={kind!r})")
    lines = [f"<!-- from {source} -->", f"Measured on: {machine_text(report.get('machine', {}))}."]
    lines.append(_workload_line(report))
    lines += ["", renderers[kind](report, markdown=True)]
    for path in report.get("plots", []):
        link = os.path.relpath(path, relative_to) if relative_to else path
        lines += ["", f"![{os.path.basename(path)}]({link})"]
    return "\n".join(lines)


def _workload_line(report: dict) -> str:
    parts = [f"{report.get('num_prompts')} prompts"]
    if report.get("workload"):
        parts.insert(0, f"workload {report['workload']}")
    if report.get("engine_args"):
        args = report["engine_args"]
        keys = ("model", "dtype", "device", "max_num_seqs", "batching", "kv_cache_memory")
        parts.append(", ".join(f"{k}={args.get(k)}" for k in keys if k in args))
    if report.get("benchmark") == "serve":
        parts.append(
            f"request rate {report['request_rate']}, max concurrency {report['max_concurrency']}"
        )
    return "; ".join(parts) + "."


def render_files(paths: list[str], relative_to: str | None = None) -> str:
    sections = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            sections.append(render(json.load(f), path, relative_to))
    return "\n\n".join(sections)

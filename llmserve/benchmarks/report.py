"""Printing and saving benchmark results: plain-text tables and JSON files."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from llmserve.cpuinfo import cpu_fields


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False
) -> str:
    """A left-aligned first column, right-aligned others; floats with 2 decimals."""
    cells = [[_cell(v) for v in row] for row in rows]
    if markdown:
        rule = ["---"] + ["---:"] * (len(headers) - 1)
        return "\n".join("| " + " | ".join(r) + " |" for r in [list(headers), rule, *cells])
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        first = values[0].ljust(widths[0])
        return "  ".join([first, *(v.rjust(w) for v, w in zip(values[1:], widths[1:]))])

    return "\n".join([line(list(headers)), line(["-" * w for w in widths]), *map(line, cells)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "num_cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    settings = cpu_settings()
    if settings:
        info["llmserve_cpu_env"] = settings
    return info


def cpu_settings() -> dict[str, str]:
    """The ``LLMSERVE_CPU_*`` variables set (kernel path, thread pinning, the AMX GEMM): they
    change what a CPU run measures."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("LLMSERVE_CPU_")}


def json_safe(value: Any) -> Any:
    """Strict JSON: infinite rates become the string "inf", NaN becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def machine_text(machine: dict[str, Any]) -> str:
    where = machine.get("gpu") or f"{machine.get('cpu')} CPU, {machine.get('num_cpus')} cores"
    text = f"{where}; torch {machine.get('torch')}, Python {machine.get('python')}, {machine.get('platform')}"
    settings = machine.get("llmserve_cpu_env") or {}
    if settings:
        text += "; " + " ".join(f"{k}={v}" for k, v in settings.items())
    return text


def _cpu_name() -> str:
    return cpu_fields().get("model name") or platform.processor() or platform.machine()


def write_json(path: str | None, report: dict[str, Any]) -> None:
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_safe(report), f, indent=2, default=str, allow_nan=False)
        f.write("\n")
    print(f"wrote {path}")

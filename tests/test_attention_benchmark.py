"""``python -m llmserve.benchmarks.attention`` runs its CPU part on a small shape and writes
JSON (numbers are not checked: benchmarks are not tests)."""

from __future__ import annotations

import json

from llmserve.benchmarks import attention


def test_cpu_mode_writes_json(tmp_path, capsys):
    path = tmp_path / "attention.json"
    argv = ["--batch", "2", "--contexts", "16", "40", "--repeats", "1", "--skip-gpu"]
    attention.main([*argv, "--output-json", str(path)])
    report = json.loads(path.read_text())
    assert "gpu" not in report
    steps, paged = report["cpu"]["step"], report["cpu"]["paged_vs_contiguous"]
    assert [s["context"] for s in steps] == [p["context"] for p in paged] == [16, 40]
    for step in steps:
        parts = step["attention_ms"] + step["matmul_ms"] + step["other_ms"]
        assert step["step_ms"] > 0 and parts >= step["step_ms"] * 0.99
        assert 0 < step["attention_share"] < 1 and 0 < step["matmul_share"] < 1
    for row in paged:
        assert row["batch"] == 2 and row["paged_ms"] > 0 and row["contiguous_sdpa_ms"] > 0
        assert row["paged_path"] == "cpp" and row["paged_cpp_ms"] == row["paged_ms"]
        assert row["max_abs_diff"] < 1e-4  # every path attends over the same K/V
    assert "paged (C++ kernel; torch gathered tiles) vs SDPA" in capsys.readouterr().out

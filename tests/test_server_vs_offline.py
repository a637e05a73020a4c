"""benchmarks/server_vs_offline.py: a real pair (the offline engine, then a real server on
loopback with llmserve's client, the same prompts), its ratio, the CPU the server's threads
and the client used, and the verdict."""

from __future__ import annotations

import json
import os

import pytest
from benchmark_scripts import load_script
from server_process import free_port


@pytest.fixture(scope="module")
def svo():
    return load_script("server_vs_offline")


def test_a_pair_runs_offline_then_a_server_on_the_same_prompts(svo, tmp_path, capsys):
    svo.main(["--pairs", "1", "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
              "--port", str(free_port()), "--out", str(tmp_path), "--stream-interval", "2"])  # fmt: skip
    (one,) = json.loads((tmp_path / "results.json").read_text())["pairs"]
    assert one["offline"] > 0 and one["server"] > 0
    assert one["ratio"] == pytest.approx(one["server"] / one["offline"])
    client = json.loads((tmp_path / "client-1.json").read_text())
    offline = json.loads((tmp_path / "offline-1.json").read_text())
    assert client["completed"] == 2 and client["total_output_tokens"] == 2 * 4
    assert offline["results"][0]["num_requests"] == 2
    assert client["total_prompt_tokens"] == offline["results"][0]["total_prompt_tokens"] == 32
    # the server's whole process (which computed the outputs) includes its main (HTTP)
    # thread; the client, a Python process that imported llmserve and read a tokenizer, used
    # CPU of its own
    assert 0 <= one["http_cpu_s"] <= one["server_cpu_s"] and one["server_cpu_s"] > 0
    assert one["client_cpu_s"] > 0.5
    # the offline run's process loaded the model and computed its outputs; the VM's steal
    # time over each half is a difference of a counter, so never negative
    assert one["offline_cpu_s"] > 0.5
    assert one["offline_steal_s"] >= 0 and one["server_steal_s"] >= 0
    assert "median" in capsys.readouterr().out


def test_the_verdict_is_the_median_pairs_against_the_target(svo):
    cpu = {"http_cpu_s": 0.5, "server_cpu_s": 60.0, "client_cpu_s": 5.0,
           "offline_cpu_s": 70.0, "offline_steal_s": 0.4, "server_steal_s": 3.5}  # fmt: skip
    pairs = [{"pair": i, "offline": 100.0, "server": s, "ratio": s / 100, **cpu} for i, s in
             enumerate([90.0, 96.0, 99.0], 1)]  # fmt: skip
    assert "median 0.960 (target >= 0.95: met)" in svo.summary(pairs, "float32")
    assert "NOT met" in svo.summary(pairs[:1], "bfloat16")
    assert "| 1 | 100.0 | 90.0 | 0.900 | 0.50 / 60.0 / 5.0 | 70.0 | 0.4 / 3.5 |" in svo.summary(
        pairs, "float32"
    )


def test_steal_is_the_cpu_lines_eighth_count_in_seconds(svo, tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice, then a CPU's own line
    stat.write_text(f"cpu  10 0 5 900 3 0 1 {7 * tick} 0 0\ncpu0 5 0 2 450 1 0 0 99 0 0\n")
    assert svo.steal_s(stat) == 7.0
    stat.write_text("cpu  10 0 5 900\n")  # a kernel without the steal column
    assert svo.steal_s(stat) == 0.0

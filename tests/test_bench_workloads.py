"""Benchmark workloads and metrics: deterministic, the advertised sizes, well-formed output."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from llmserve.benchmarks import workloads
from llmserve.benchmarks.metrics import (
    RequestRecord,
    arrival_times,
    latency_result,
    summarize_ms,
    throughput_result,
)
from llmserve.benchmarks.report import format_table, json_safe


@pytest.fixture(scope="module")
def tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer(None)


def test_text2sql_is_deterministic_and_about_140_tokens(tokenizer):
    first = workloads.make_requests(tokenizer, "text2sql", 200, seed=0)
    again = workloads.make_requests(tokenizer, "text2sql", 200, seed=0)
    other = workloads.make_requests(tokenizer, "text2sql", 200, seed=1)
    assert first == again
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert len({r.prompt for r in first}) > 190  # varied tables, columns and questions
    mean_len = statistics.mean(r.prompt_len for r in first)
    assert 100 <= mean_len <= 180
    assert all(r.output_len == 64 for r in first)
    assert all("CREATE TABLE" in r.prompt and "-- Question:" in r.prompt for r in first)
    assert {r.prompt.count("CREATE TABLE") for r in first} == {1, 2, 3}
    assert all(r.prompt_token_ids == tokenizer.encode(r.prompt) for r in first[:5])


def test_output_len_overrides_every_workload(tokenizer):
    for name in workloads.WORKLOADS:
        requests = workloads.make_requests(tokenizer, name, 5, input_len=16, output_len=7)
        assert [r.output_len for r in requests] == [7] * 5


def test_chat_output_lengths_follow_clipped_lognormal():
    lens = workloads.chat_output_lens(2000, seed=0)
    assert lens == workloads.chat_output_lens(2000, seed=0)
    assert min(lens) >= 8 and max(lens) <= 1024
    assert 90 <= statistics.median(lens) <= 110
    # heavy tail: the mean well above the median, a few very long answers
    assert statistics.mean(lens) > 1.3 * statistics.median(lens)
    assert sum(n >= 500 for n in lens) >= 20
    # log-normal: log lengths (away from the clips) have sigma near 1
    logs = [math.log(n) for n in lens if 8 < n < 1024]
    assert 0.85 <= statistics.stdev(logs) <= 1.1


def test_chat_prompts_are_short_chat_templated(tokenizer):
    requests = workloads.make_requests(tokenizer, "chat", 20, seed=3)
    assert requests == workloads.make_requests(tokenizer, "chat", 20, seed=3)
    assert all(r.prompt_len < 80 for r in requests)
    assert all("<|im_start|>assistant" in r.prompt for r in requests)


def test_random_workload_has_exact_input_len(tokenizer):
    requests = workloads.make_requests(tokenizer, "random", 4, seed=0, input_len=32, output_len=5)
    assert requests == workloads.make_requests(
        tokenizer, "random", 4, seed=0, input_len=32, output_len=5
    )
    assert [r.prompt_len for r in requests] == [32] * 4
    special = set(tokenizer.all_special_ids)
    assert not any(t in special for r in requests for t in r.prompt_token_ids)


def test_dataset_jsonl(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Hello there", "output_len": 3}, {"prompt": "SELECT 1"}, {"prompt": "x"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    requests = workloads.make_requests(tokenizer, "text2sql", 2, dataset=str(path))
    assert [(r.prompt, r.output_len) for r in requests] == [("Hello there", 3), ("SELECT 1", 128)]
    assert [
        r.output_len
        for r in workloads.make_requests(tokenizer, "chat", 5, dataset=str(path), output_len=9)
    ] == [9] * 3
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        workloads.make_requests(tokenizer, "text2sql", 2, dataset=str(path))


def test_bad_workload_arguments(tokenizer):
    with pytest.raises(ValueError, match="num-prompts"):
        workloads.make_requests(tokenizer, "text2sql", 0)
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.make_requests(tokenizer, "poetry", 2)


def test_poisson_arrivals():
    offsets = arrival_times(2000, 10.0, seed=0)
    assert offsets == arrival_times(2000, 10.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert 180 <= offsets[-1] <= 220  # 2000 arrivals at 10/s take about 200 s
    assert arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, seed=0)


def test_latency_metrics():
    records = [RequestRecord(10, 5, 0.1, 0.5, [0.1] * 4), RequestRecord(10, error="HTTP 500")]
    result = latency_result(records, duration_s=2.0)
    assert result["completed"] == 1 and result["failed"] == 1
    assert result["output_throughput"] == pytest.approx(2.5)
    assert result["median_ttft_ms"] == pytest.approx(100.0)
    assert result["mean_tpot_ms"] == pytest.approx(100.0)
    assert result["p99_itl_ms"] == pytest.approx(100.0)
    assert summarize_ms("x", []) == {f"{k}_x_ms": None for k in ("mean", "median", "p90", "p99")}


def test_throughput_result_and_report_helpers():
    requests = [workloads.BenchRequest("a", [1, 2], 3)] * 2
    result = throughput_result("llmserve", requests, 2.0, 6)
    assert result["request_throughput"] == 1.0
    assert result["output_throughput"] == 3.0
    assert result["total_token_throughput"] == 5.0
    assert json.loads(json.dumps(json_safe({"rate": math.inf, "x": [math.nan]}))) == {
        "rate": "inf",
        "x": [None],
    }
    table = format_table(["backend", "tok/s"], [["llmserve", 1.5], ["hf", None]])
    assert table.splitlines()[2].split() == ["llmserve", "1.50"]

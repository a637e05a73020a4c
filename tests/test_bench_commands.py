"""``llmserve bench ...`` end to end on tiny workloads: JSON with the promised keys, PNG plots.

No timing is asserted: these runs check that the tools work, not how fast anything is.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from llmserve.entrypoints.cli import main
from tests.server_process import ServerProcess, free_port

SMALL_ENGINE = ["--kv-cache-memory", "100000000", "--max-model-len", "512"]
TINY = ["--num-prompts", "3", "--output-len", "4", "--disable-tqdm"]
HEADLINE = ("request_throughput", "output_throughput", "total_token_throughput")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> list[str]:
    """``--model`` of a tiny random Llama with its own tokenizer: the tools' runs, not a real
    model's speed, are under test (the default model cost 3.6 s per engine load here)."""
    from tests.quantization.tiny_llama import save_tiny_llama

    path = str(tmp_path_factory.mktemp("tiny-llama"))
    save_tiny_llama(path, max_position_embeddings=512)
    return ["--model", path]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Two shared, busy cores: OpenMP threads spin against other processes' and crawl."""
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def read_json(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)  # strict: no NaN / Infinity literals


def has_hf_continuous_batching() -> bool:
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "init_continuous_batching")


def test_throughput_llmserve_and_peers(tmp_path, capsys, tiny_model):
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--backend", "all", "--hf-batch-size", "2", *TINY, *SMALL_ENGINE]
    argv += tiny_model
    ids_file = tmp_path / "prompt_ids.json"
    argv += ["--save-prompt-ids", str(ids_file)]
    assert main([*argv, "--num-prompts", "2", "--output-json", str(out)]) == 0
    report = read_json(out)
    prompt_ids = read_json(ids_file)  # for a peer that runs the same ids
    assert len(prompt_ids) == 2 and all(
        ids and all(type(t) is int for t in ids) for ids in prompt_ids
    )
    assert all(report[k] > 0 for k in HEADLINE)
    results = {r["backend"]: r for r in report["results"]}
    expected = {"llmserve", "transformers"} | (
        {"transformers-cb"} if has_hf_continuous_batching() else set()
    )
    assert expected <= set(results)
    for result in results.values():
        assert result["num_requests"] == 2
        assert result["total_output_tokens"] == 8  # 2 prompts x 4 tokens, EOS ignored
        assert all(result[k] > 0 for k in HEADLINE)
    llmserve = results["llmserve"]
    assert report["request_throughput"] == llmserve["request_throughput"]
    assert llmserve["output_throughput_vs_llmserve"] == 1.0
    assert llmserve["max_seqs_per_step"] == 2 and llmserve["num_steps"] >= 4
    assert llmserve["num_preemptions"] == 0 and 0.0 <= llmserve["prefix_hit_rate"] <= 1.0
    assert 1.0 <= llmserve["mean_seqs_per_step"] <= 2.0
    if "llama-cpp" not in results:
        assert "not installed" in report["skipped"]["llama-cpp"]
    capsys.readouterr()
    assert main(["bench", "report", str(out)]) == 0
    markdown = capsys.readouterr().out
    assert "| backend | requests/s |" in markdown and "| llmserve |" in markdown


def test_sweep_writes_json_and_plots(tmp_path, capsys, tiny_model):
    out_dir = tmp_path / "sweep"
    argv = ["bench", "sweep", *TINY, *SMALL_ENGINE, *tiny_model, "--output-dir", str(out_dir)]
    argv += [
        "--batch-sizes",
        "1,2",
        "--request-rates",
        "16",
        "--output-json",
        str(tmp_path / "s.json"),
    ]
    assert main(argv) == 0
    report = read_json(out_dir / "sweep.json")
    assert report == read_json(tmp_path / "s.json")
    assert [p["max_num_seqs"] for p in report["batch_size_sweep"]] == [1, 2]
    assert report["batch_size_sweep"][0]["max_seqs_per_step"] == 1
    for point in report["batch_size_sweep"]:
        assert point["total_output_tokens"] == 12 and point["output_throughput"] > 0
    assert [p["batching"] for p in report["rate_sweep"]] == ["continuous", "dynamic", "static"]
    for point in report["rate_sweep"]:
        assert point["request_rate"] == 16.0 and point["completed"] == 3
        assert point["total_output_tokens"] == 12
        assert point["p99_ttft_ms"] >= point["median_ttft_ms"] > 0
        assert point["p99_e2el_ms"] >= point["median_e2el_ms"] >= point["median_ttft_ms"]
    assert sorted(os.path.basename(p) for p in report["plots"]) == [
        "latency_vs_request_rate.png",
        "throughput_vs_batch_size.png",
    ]
    for path in report["plots"]:
        data = open(path, "rb").read()
        assert data.startswith(PNG_MAGIC)
        assert b"Matplotlib" in data[:200]  # the Software text chunk matplotlib writes
    capsys.readouterr()
    assert (
        main(["bench", "report", str(out_dir / "sweep.json"), "--relative-to", str(tmp_path)]) == 0
    )
    markdown = capsys.readouterr().out
    assert "| continuous | 16 |" in markdown
    assert "](sweep/latency_vs_request_rate.png)" in markdown


@pytest.fixture(scope="module")
def server(tiny_model):
    """``llmserve serve`` on the tiny model, started as a user starts it, shared by the
    module's two runs against it; its URL."""
    server = ServerProcess(*tiny_model, *SMALL_ENGINE, env={"OMP_NUM_THREADS": "1"})
    yield server.url
    server.close()


def test_serve_benchmark_against_real_server(server, tmp_path):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server, *TINY, "--num-prompts", "4"]
    assert main([*argv, "--request-rate", "20", "--output-json", str(out)]) == 0
    report = read_json(out)
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 16  # max_tokens honoured with ignore_eos
    assert all(report[k] > 0 for k in HEADLINE)
    for name in ("ttft", "tpot", "itl", "e2el"):
        stats = [report[f"{s}_{name}_ms"] for s in ("mean", "median", "p90", "p99")]
        assert all(v is not None and v >= 0 for v in stats)
    assert report["median_e2el_ms"] >= report["median_ttft_ms"] > 0
    assert report["model"] and report["request_rate"] == 20.0
    # max concurrency and the chat workload (heavy-tailed lengths cut down by --output-len)
    argv = ["bench", "serve", "--base-url", server, *TINY, "--workload", "chat"]
    assert main([*argv, "--max-concurrency", "1", "--output-json", str(out)]) == 0
    report = read_json(out)
    assert report["completed"] == 3 and report["max_concurrency"] == 1
    assert report["request_rate"] == "inf"


def test_serve_benchmark_says_what_went_wrong(server, capsys):
    """A wrong model name fails on the untimed first request, with the server's answer;
    a URL where nothing listens fails on listing the models."""
    argv = ["bench", "serve", *TINY, "--num-prompts", "1", "--disable-tqdm"]
    assert main([*argv, "--base-url", server, "--served-model-name", "no-such-model"]) != 0
    assert re.search(r"test request .* failed: HTTP 404.*no-such-model", capsys.readouterr().err)
    closed = f"http://127.0.0.1:{free_port()}"
    assert main([*argv, "--base-url", closed]) != 0
    assert re.search(r"cannot list models at .*/v1/models", capsys.readouterr().err)


VOCAB_CUT = 2048  # transformers reads the file six times here: 4 s each over all 49,152 tokens


def test_export_hf_writes_a_plain_directory_with_the_gguf_weights(tmp_path):
    """The vLLM-CPU peer reads an HF directory: same weights as transformers reads from the
    GGUF, and no quantization_config left that would send vLLM looking for "gguf"."""
    import gguf
    import torch
    import transformers as T

    from llmserve.benchmarks.export_hf import export_hf
    from llmserve.loader.default_model import default_model_path
    from tests.gguf_writer import cut_bpe_vocabulary, read_vocabulary, write_gguf

    torch.manual_seed(0)
    config = T.LlamaConfig(
        vocab_size=VOCAB_CUT,  # the default model's vocabulary (cut), which transformers reads
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    T.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    vocabulary = cut_bpe_vocabulary(read_vocabulary(default_model_path()), VOCAB_CUT)
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"), q8, vocabulary)
    out = export_hf(str(tmp_path / "tiny.gguf"), str(tmp_path / "out"))
    assert "quantization_config" not in read_json(tmp_path / "out" / "config.json")
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    direct = T.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32
    )
    exported = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(exported(ids).logits, direct(ids).logits, rtol=0, atol=0)
    text = "SELECT name FROM users;"
    assert T.AutoTokenizer.from_pretrained(out).encode(text) == T.AutoTokenizer.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf"
    ).encode(text)

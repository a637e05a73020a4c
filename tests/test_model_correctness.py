"""Tier 3: greedy outputs of llmserve equal transformers' on the default model, token for token.

Each prompt alone, all together, with a tiny token budget (chunked prefill), with a tiny KV
pool (preemption), and a second time through the prefix cache.
"""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from tests.conftest import NUM_TOKENS, PROMPTS, assert_no_leaks

# min_tokens masks EOS as transformers' min_new_tokens does, so both run the full length.
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=128 << 20, max_model_len=1024)


def test_each_prompt_alone(llm, hf_greedy_reference):
    for prompt, expected in zip(PROMPTS, hf_greedy_reference):
        got = _token_ids(llm.generate([prompt], GREEDY, use_tqdm=False))[0]
        assert got == expected, prompt
    assert_no_leaks(llm)


def test_all_prompts_in_one_batch(llm, hf_greedy_reference):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == hf_greedy_reference
    assert llm.llm_engine.stats.max_batched_seqs == len(PROMPTS)
    assert_no_leaks(llm)


def test_second_pass_hits_prefix_cache(llm, hf_greedy_reference):
    bm = llm.llm_engine.block_manager
    hits_before = bm.num_prefix_hits
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == hf_greedy_reference
    assert bm.num_prefix_hits > hits_before
    assert any(o.num_cached_tokens > 0 for o in outputs)
    assert_no_leaks(llm)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_prompts_of_one_step_share_the_prefix_computed_in_it(backend):
    """Prompts admitted together read the blocks of their common prefix that the first of
    them computes in the same forward pass; the tokens are those computed without sharing."""
    prefix = "CREATE TABLE users (id INTEGER, name TEXT, email TEXT, created_at DATE);\n" * 3
    prompts = [prefix + "-- the name of user 7\nSELECT", prefix + "-- how many users\nSELECT"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    shared = LLM(kv_cache_memory=64 << 20, max_model_len=512, attention_backend=backend)
    got = shared.generate(prompts, params, use_tqdm=False)
    plain = LLM(kv_cache_memory=64 << 20, max_model_len=512, enable_prefix_caching=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert _token_ids(got) == _token_ids(want)
    assert got[0].num_cached_tokens == 0 and got[1].num_cached_tokens >= 48  # a fresh engine
    assert_no_leaks(shared)


def test_tiny_token_budget_forces_chunked_prefill(hf_greedy_reference):
    llm = LLM(
        kv_cache_memory=64 << 20,
        max_model_len=512,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
    )
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == hf_greedy_reference
    assert llm.llm_engine.stats.num_steps > NUM_TOKENS + max(len(p) for p in PROMPTS) // 7
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tiny_kv_pool_forces_preemption(hf_greedy_reference, mode):
    # 12 blocks of 8 tokens: the longest request needs 9, so few fit at once. swap (the CPU
    # default): the victims' KV goes to the swap space and comes back; recompute: dropped.
    per_block = 46080 * 8
    llm = LLM(kv_cache_memory=12 * per_block, block_size=8, max_model_len=80, preemption_mode=mode)
    engine = llm.llm_engine
    assert engine.block_manager.num_blocks == 12
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == hf_greedy_reference
    assert engine.scheduler.num_preemptions > 0
    swapped = engine.runner.swap is not None and engine.runner.swap.caches is not None
    assert swapped == (mode == "swap")
    assert_no_leaks(llm)
    assert len(engine.block_manager.free_swap_ids) == engine.block_manager.num_swap_blocks

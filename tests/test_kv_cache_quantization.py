"""``--kv-cache-dtype``: the engine on a KV pool narrower than the model (fp8 e4m3 / e5m2,
bf16 under fp32) against transformers on the same weights with its keys and values rounded
the same way wherever attention reads them, on a tiny random GQA Llama; the pool's size; the
paths that copy blocks (parallel samples, swapping); what is refused. The kernels' own checks
are tests/kernels/test_kv_cache_dtype.py; the default model's perplexity with each pool is in
docs/benchmarks.md ("KV cache quantization")."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.layers import kv_quant
from llmserve.runner.kv_cache import resolve_kv_cache_dtype
from tests.conftest import assert_no_leaks
from tests.quantization.tiny_llama import save_tiny_llama

PROMPTS = ["Hello there", "SELECT name FROM users WHERE age >", "1, 2, 3, 4, 5,"]
MAX_TOKENS = 6
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer GQA Llama (head_dim 64) with random weights and a small tokenizer; keys
    scaled up (x 40 in k_proj) so that e4m3's largest value, 448, clips some of them."""
    path = str(tmp_path_factory.mktemp("tiny-llama-kv"))
    model, tokenizer = save_tiny_llama(path, hidden_size=256, intermediate_size=256)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(40.0)
            layer.self_attn.v_proj.weight.mul_(4.0)
    model.save_pretrained(path)
    return path, tokenizer


def reference(path: str, tokenizer, kv_dtype: torch.dtype | None):
    """transformers' greedy tokens and their logprobs, with every attention read of K and V
    (after rotary, the prompt's own included) rounded to ``kv_dtype`` (None: as they are)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(module, query, key, value, attention_mask, **kwargs):
        if kv_dtype is not None:
            key = kv_quant.round_trip(key, kv_dtype, 1.0)
            value = kv_quant.round_trip(value, kv_dtype, 1.0)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("llmserve_rounded_kv", rounded)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="llmserve_rounded_kv")
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        new = out.sequences[0, ids.shape[1] :].tolist()
        steps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)]
        tokens.append(new)
        logprobs.append(steps)
    return tokens, logprobs


def generate(path: str, **options):
    llm = LLM(path, max_model_len=256, **options)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0
    )
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_no_leaks(llm)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [
        [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outputs
    ]
    return llm, tokens, logprobs


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("name", KV_DTYPES)
def test_matches_transformers_with_rounded_kv(tiny_llama, name, backend):
    """Greedy tokens and their logprobs equal transformers' with K/V rounded the same way; the
    rounding matters (the unrounded reference's logprobs differ by more than the tolerance).
    A 5-token budget splits the prompts into chunks that share steps with decodes."""
    path, tokenizer = tiny_llama
    want_tokens, want_logprobs = reference(path, tokenizer, KV_DTYPES[name])
    llm, tokens, logprobs = generate(
        path, attention_backend=backend, kv_cache_dtype=name, kv_cache_memory=2 << 20,
        block_size=8, max_num_batched_tokens=5,
    )  # fmt: skip
    assert llm.llm_engine.runner.attention_backend == backend
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == KV_DTYPES[name]
    assert tokens == want_tokens
    torch.testing.assert_close(
        torch.tensor(logprobs), torch.tensor(want_logprobs), atol=2e-3, rtol=0
    )
    if name != "bfloat16":  # (bf16's rounding is within the tolerance on this model)
        _, exact_logprobs = reference(path, tokenizer, None)
        diff = (torch.tensor(exact_logprobs) - torch.tensor(want_logprobs)).abs().max().item()
        assert diff > 1e-2, f"rounding K/V to {name} changed no logprob by more than {diff}"


def test_pool_holds_more_tokens(tiny_llama):
    path, _ = tiny_llama
    blocks = {}
    for name in ("auto", "bfloat16", "fp8"):
        llm = LLM(path, max_model_len=256, kv_cache_dtype=name, kv_cache_memory=4 << 20)
        blocks[name] = llm.llm_engine.block_manager.num_blocks
        assert (
            str(KV_DTYPES.get(name, torch.float32)).removeprefix("torch.") in llm.llm_engine.kv_info
        )
    assert blocks["bfloat16"] == 2 * blocks["auto"] and blocks["fp8"] == 4 * blocks["auto"]


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_copied_and_swapped_blocks(tiny_llama, preemption):
    """Parallel samples share their prompt's fp8 blocks and copy one on write; a pool of 12
    blocks of 8 preempts sequences (swapped out and back, or recomputed): the outputs equal
    a roomy pool's."""
    path, _ = tiny_llama
    params = SamplingParams(temperature=0.0, n=3, max_tokens=20, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[2]]

    def run(kv_bytes: int) -> list[list[list[int]]]:
        llm = LLM(
            path, max_model_len=64, kv_cache_dtype="fp8", kv_cache_memory=kv_bytes, block_size=8,
            preemption_mode=preemption, enable_prefix_caching=False,
        )  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(llm)
        return llm, [[c.token_ids for c in o.outputs] for o in outputs]

    per_block = 2 * 2 * 2 * 64 * 8  # K and V, 2 layers, 2 KV heads, head_dim 64, one byte each
    small, tight = run(12 * per_block)
    _, roomy = run(400 * per_block)
    assert small.llm_engine.block_manager.num_blocks == 12
    assert tight == roomy


def test_refused_with_what_is_allowed(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'fp8_e5m2'.*got 'int4'"):
        LLM(path, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="Triton kernels read the model's dtype only"):
        resolve_kv_cache_dtype("fp8", torch.float16, "triton")
    with pytest.raises(ValueError, match="bfloat16 narrows an fp32 model's cache"):
        resolve_kv_cache_dtype("bfloat16", torch.float16, "torch")
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, "cpp") == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpp") == torch.float32
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, "cpp") == torch.float8_e4m3fn

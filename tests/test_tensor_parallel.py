"""Tensor parallelism on CPU with gloo: TP=2 matches TP=1, and the splits it refuses.

Each TP engine spawns one worker process (rank 1); dropping the engine stops it and leaves the
process group, so the next engine can form its own.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.distributed.plan import make_plan
from llmserve.distributed.weights import shard_weights
from llmserve.distributed.workers import START_METHOD_ENV
from llmserve.sampling_params import BeamSearchParams
from tests.conftest import assert_no_leaks
from tests.quantization.tiny_llama import save_tiny_llama

PROMPTS = ["Write SQL that counts rows of t.", "Hello, my name is", "def fibonacci(n):"]
LOGPROB_ATOL = 1e-4  # fp32, summed in another order across two ranks


def _run(llm: LLM, max_tokens: int = 12, prompts: list | None = None) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, prompt_logprobs=3)
    return llm.generate(prompts or PROMPTS, params, use_tqdm=False)


def _assert_close(single: list, split: list) -> None:
    for a, b in zip(single, split, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            for token, lp in step_a.items():
                assert abs(_value(lp) - _value(step_b[token])) < LOGPROB_ATOL
        for pos_a, pos_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            for token, lp in pos_a.items():
                assert abs(_value(lp) - _value(pos_b[token])) < LOGPROB_ATOL


def _value(logprob) -> float:
    return logprob.logprob if hasattr(logprob, "logprob") else float(logprob)


def _forks(llm: LLM) -> list[list[int]]:
    """Seeded n=2 sampling and beam search: forks share blocks, copied on write on every rank."""
    sampled = SamplingParams(temperature=0.8, max_tokens=20, n=2, seed=0)
    beams = BeamSearchParams(beam_width=3, max_tokens=12)
    outs = llm.generate(PROMPTS[:2], sampled, use_tqdm=False)
    tokens = [c.token_ids for o in outs for c in o.outputs]
    return tokens + [s.tokens for o in llm.beam_search(PROMPTS[:2], beams) for s in o.sequences]


def _compare(
    model: str | None,
    with_forks: bool = False,
    info: str | None = None,
    prompts: list | None = None,
    **options,
) -> None:
    single = LLM(model, **options)
    expected, expected_forks = _run(single, prompts=prompts), with_forks and _forks(single)
    del single
    split = LLM(model, tensor_parallel_size=2, **options)
    try:
        _assert_close(expected, _run(split, prompts=prompts))
        assert info is None or info in split.llm_engine.kv_info
        if with_forks:
            assert _forks(split) == expected_forks
        assert_no_leaks(split)
    finally:
        del split  # stops the worker and leaves the process group
        gc.collect()


def test_default_model_tp2_matches_tp1(monkeypatch):
    """9 heads / 3 KV heads over 2 ranks: an uneven 6/3 split by KV group. The worker is
    spawned, as by default (the other tests fork theirs from a forkserver: conftest)."""
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    _compare(None, kv_cache_memory=48 << 20, max_model_len=256)


def test_unknown_worker_start_method_is_refused(monkeypatch, odd_kv_model):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="choose one of spawn, forkserver"):
        LLM(odd_kv_model, tensor_parallel_size=2, max_model_len=64, kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def odd_kv_model(tmp_path_factory) -> str:
    """3 KV heads (groups of 2), untied LM head, vocabulary not a multiple of 2 ranks."""
    path = str(tmp_path_factory.mktemp("tiny-odd-kv"))
    save_tiny_llama(
        path,
        num_attention_heads=6,
        num_key_value_heads=3,
        hidden_size=96,
        intermediate_size=192,
        tie_word_embeddings=False,
    )
    return path


def test_odd_kv_heads_tp2_matches_tp1(odd_kv_model):
    _compare(
        odd_kv_model,
        with_forks=True,
        kv_cache_memory=8 << 20,
        max_model_len=128,
        attention_backend="torch",
    )


def test_replicated_kv_head_tp2_matches_tp1(tmp_path):
    """One KV head (MQA), two ranks: each holds a copy of it and half the query heads."""
    save_tiny_llama(str(tmp_path), num_attention_heads=4, num_key_value_heads=1)
    _compare(str(tmp_path), kv_cache_memory=8 << 20, max_model_len=128, attention_backend="torch")


def test_runtime_quantization_quantizes_each_shard(odd_kv_model):
    """int8 per output channel: row-parallel shards take their scales over their own columns,
    so TP=2 is close to TP=1 (prompt logprobs, no feedback), not bit-equal."""
    options = dict(quantization="int8", max_model_len=128, kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    single = LLM(odd_kv_model, **options)
    expected = single.generate(PROMPTS, params, use_tqdm=False)
    del single
    split = LLM(odd_kv_model, tensor_parallel_size=2, **options)
    try:
        got = split.generate(PROMPTS, params, use_tqdm=False)
        assert "int8" in split.llm_engine.kv_info
    finally:
        del split
        gc.collect()
    for a, b in zip(expected, got, strict=True):
        for pos_a, pos_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            for token in pos_a.keys() & pos_b.keys():
                assert abs(_value(pos_a[token]) - _value(pos_b[token])) < 0.02  # 0.004 seen


@pytest.mark.parametrize(
    "name",
    [
        "qwen3",
        "gemma2",
        "gemma3",
        "mixtral",
        "qwen3-moe",
        "gpt2",
        "bloom",
        "falcon-40b-style",
        "phi3",
        "gpt-bigcode",
        "opt-350m-style",
    ],
)
def test_family_tp2_matches_tp1(name, tmp_path):
    """Beyond Llama: q/k norms (Qwen3, Gemma 3), a replicated KV head, soft-capping and
    sliding windows (Gemma 2/3), the scaled and tied embedding (Gemma), mixtures of experts
    (every rank holds its share of each expert's columns, the router replicated), and the
    checkpoints whose q/k/v come fused: GPT-2's Conv1D ``c_attn`` with biases, BLOOM's
    per-head interleaved qkv and ALiBi slopes, Falcon-40B's per-KV-group qkv, Phi-3's fused
    qkv and gate_up, GPT-BigCode's multi-query head, OPT-350m's embedding projections."""
    from llmserve.tokenizer import get_tokenizer
    from tests.test_model_families import PROMPTS as TOKEN_PROMPTS
    from tests.test_model_families import _save

    _save(name, tmp_path, get_tokenizer(None))
    _compare(
        str(tmp_path),
        prompts=[{"prompt_token_ids": p} for p in TOKEN_PROMPTS],  # ids within the tiny vocab
        kv_cache_memory=8 << 20,
        max_model_len=64,
        attention_backend="torch",
    )


def test_gguf_blocks_tp2_matches_tp1(odd_kv_model, tmp_path):
    """A GGUF file's Q4_0 blocks cut per rank (o/down on block boundaries, the quantized token
    table and LM head by vocabulary rows, padded) give TP=1's tokens and log-probs."""
    from gguf import GGMLQuantizationType

    from tests.gguf_writer import write_gguf

    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, odd_kv_model, qtype=GGMLQuantizationType.Q4_0)
    _compare(
        path,
        info="int4",  # each rank holds 4-bit blocks
        quantization="gguf",
        quantized_activations="float",  # float32 math on the blocks: equal up to sum order
        kv_cache_memory=8 << 20,
        max_model_len=128,
    )


def test_quantized_experts_tp2_matches_tp1(tmp_path):
    """A Mixtral GGUF whose stacked experts are Q4_0 blocks: each rank cuts every expert's
    blocks (gate/up by rows, down by 32-column blocks)."""
    from gguf import GGMLQuantizationType

    from tests.gguf_writer import write_gguf
    from tests.quantization.test_quantized_moe import _save as save_moe

    save_moe("mixtral", tmp_path / "hf")
    path = str(tmp_path / "moe.gguf")
    write_gguf(path, str(tmp_path / "hf"), qtype=GGMLQuantizationType.Q4_0)
    _compare(
        path,
        info="int4",
        prompts=[{"prompt_token_ids": p} for p in ([5, 9, 77, 300, 2], [400, 3, 3, 17])],
        quantization="gguf",
        quantized_activations="float",
        kv_cache_memory=8 << 20,
        max_model_len=64,
    )


def test_gptq_checkpoint_tp2_matches_tp1(odd_kv_model, tmp_path):
    from llmserve.quantization import quantize

    quantize(odd_kv_model, str(tmp_path / "gptq"), method="rtn", bits=4, group_size=32)
    _compare(
        str(tmp_path / "gptq"),
        info="int4",
        quantized_activations="float",
        kv_cache_memory=8 << 20,
        max_model_len=128,
    )


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_tp2_is_lossless(method, odd_kv_model):
    """Speculative decoding under TP=2 (n-gram drafts, or a separate draft model whole on
    rank 0: here the same weights, so greedy drafts are accepted): the greedy tokens of TP=1
    without speculation, with drafts verified by the split target."""
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = odd_kv_model
    options = dict(kv_cache_memory=8 << 20, max_model_len=128, attention_backend="torch")
    prompts = PROMPTS + ["one two three one two three one two three one two"]  # n-gram fodder
    greedy = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    single = LLM(odd_kv_model, **options)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, greedy, use_tqdm=False)]
    del single
    split = LLM(odd_kv_model, tensor_parallel_size=2, speculative_config=config, **options)
    try:
        outputs = split.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        stats = split.llm_engine.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        assert_no_leaks(split)
    finally:
        del split
        gc.collect()


def test_self_drafting_target_is_refused_under_tp(odd_kv_model):
    config = {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "int8"}
    with pytest.raises(ValueError, match="a target drafting for itself"):
        LLM(odd_kv_model, tensor_parallel_size=2, speculative_config=config)


def test_quantized_weights_are_cut_on_group_boundaries():
    from llmserve.quantization.layout import QuantizedWeight, pack_int4

    config = _config(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16)
    shard = make_plan(config, 2).shards[1]  # q heads 2..3: o_proj input columns 32..64
    codes = torch.randint(0, 16, (64, 64))
    scales = torch.rand(64, 2)
    weight = QuantizedWeight(4, pack_int4(codes), scales, None, 32)
    name = "model.layers.0.self_attn.o_proj.weight"
    ((_, cut),) = shard_weights(iter([(name, weight)]), shard)
    assert torch.equal(cut.dequantize(), weight.dequantize()[:, 32:])
    grouped = QuantizedWeight(4, pack_int4(codes), scales[:, :1], None, 64)  # one group of 64
    with pytest.raises(ValueError, match=r"o_proj.weight: this rank's input columns 32..64"):
        list(shard_weights(iter([(name, grouped)]), shard))
    act_order = QuantizedWeight(4, pack_int4(codes), scales, None, 32, perm=torch.arange(64))
    with pytest.raises(ValueError, match="act-order"):
        list(shard_weights(iter([(name, act_order)]), shard))


def test_plan_splits_by_kv_group():
    config = _config(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    plan = make_plan(config, 2)
    assert [(s.q_heads, s.kv_heads) for s in plan.shards] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert plan.max_kv_heads == 2
    mqa = make_plan(_config(num_attention_heads=4, num_key_value_heads=1), 2)  # replicated KV
    assert [(s.q_heads, s.kv_heads) for s in mqa.shards] == [((0, 2), (0, 1)), ((2, 4), (0, 1))]


def test_weights_are_sliced_as_they_stream():
    config = _config(num_attention_heads=4, num_key_value_heads=2, vocab_size=11)
    shard = make_plan(config, 2).shards[1]
    d = shard.head_dim
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(4 * d * 8.0).reshape(4 * d, 8),
        "model.layers.0.self_attn.o_proj.weight": torch.ones(8, 4 * d),
        "model.layers.0.mlp.down_proj.weight": torch.ones(8, 64),
        "model.embed_tokens.weight": torch.ones(11, 8),
    }
    sliced = dict(shard_weights(iter(full.items()), shard))
    q = sliced["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][2 * d :])
    assert sliced["model.layers.0.self_attn.o_proj.weight"].shape == (8, 2 * d)
    assert sliced["model.layers.0.mlp.down_proj.weight"].shape == (8, 32)
    embed = sliced["model.embed_tokens.weight"]  # rows 6..10, padded to 6 with zeros
    assert embed.shape == (6, 8) and embed[:5].eq(1).all() and embed[5].eq(0).all()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "intermediate", "size", "message"),
    [
        (6, 1, 64, 4, "does not divide the model's 6 attention heads"),
        (9, 3, 1536, 4, "cannot split the model's 3 KV heads"),
        (6, 3, 100, 3, "does not divide the model's intermediate size 100"),
    ],
)
def test_refused_splits_say_which(heads, kv_heads, intermediate, size, message):
    config = _config(
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate
    )
    with pytest.raises(ValueError, match=message):
        make_plan(config, size)


def test_errors_before_any_work(odd_kv_model):
    with pytest.raises(ValueError, match="ranks on this machine but it has"):
        LLM(odd_kv_model, tensor_parallel_size=3)  # 2 cores here; 3 KV heads split fine
    with pytest.raises(ValueError, match="cannot split the model's 3 KV heads"):
        LLM(odd_kv_model, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        LLM(odd_kv_model, tensor_parallel_size=2, quantization="gguf")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(odd_kv_model, tensor_parallel_size=0)


def _config(**overrides):
    options = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=32,
    )
    return SimpleNamespace(**{**options, **overrides})

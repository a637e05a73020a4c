"""Tier 3 for every model family: a tiny random model built from transformers' own config
class, saved with save_pretrained, loaded by llmserve. Prompt log-probabilities must be close to
transformers' (so the logits agree up to a per-row constant), greedy continuations identical:
prompts of different lengths batched together, then again through a prefix-cache hit.
Sliding-window families get a window shorter than the prompts.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton cases run on CPU, interpreted

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from tests.conftest import assert_no_leaks  # noqa: E402

VOCAB = 512
NUM_TOKENS = 8
TOP = 5
WINDOW = 6  # sliding window for the families that have one: shorter than every prompt but one
_gen = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_gen).tolist() for n in (5, 13, 21)]

LLAMA_LIKE: dict = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)

GPT = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128)
BLOOM_LIKE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
MOE = dict(num_experts_per_tok=2)
GEMMA = dict(LLAMA_LIKE, head_dim=24, num_key_value_heads=1, tie_word_embeddings=True)
FAMILIES = {
    "gpt2": lambda: T.GPT2Config(**GPT),
    "opt": lambda: T.OPTConfig(**BLOOM_LIKE, ffn_dim=96, max_position_embeddings=128),
    "opt-350m-style": lambda: T.OPTConfig(
        **BLOOM_LIKE,
        ffn_dim=96,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
        do_layer_norm_before=False,
    ),
    "bloom": lambda: T.BloomConfig(vocab_size=VOCAB, hidden_size=96, n_layer=2, n_head=6),
    "mpt": lambda: T.MptConfig(vocab_size=VOCAB, d_model=96, n_layers=2, n_heads=6),
    "falcon-7b-style": lambda: T.FalconConfig(**BLOOM_LIKE, multi_query=True, parallel_attn=True),
    "falcon-40b-style": lambda: T.FalconConfig(
        **BLOOM_LIKE, new_decoder_architecture=True, num_kv_heads=2, bias=True
    ),
    "gpt-neox": lambda: T.GPTNeoXConfig(
        **BLOOM_LIKE, intermediate_size=96, max_position_embeddings=128, rotary_pct=0.25
    ),
    "gpt-neox-sequential": lambda: T.GPTNeoXConfig(
        **BLOOM_LIKE, intermediate_size=96, use_parallel_residual=False, rotary_pct=0.5
    ),
    "gptj": lambda: T.GPTJConfig(**GPT, rotary_dim=8),
    "gpt-bigcode": lambda: T.GPTBigCodeConfig(**GPT, multi_query=True),
    "gpt-bigcode-mha": lambda: T.GPTBigCodeConfig(**GPT, multi_query=False),
    "phi": lambda: T.PhiConfig(**LLAMA_LIKE, partial_rotary_factor=0.5),
    "phi3": lambda: T.Phi3Config(**LLAMA_LIKE, pad_token_id=0, sliding_window=WINDOW),
    "gemma": lambda: T.GemmaConfig(**GEMMA),
    "gemma2": lambda: T.Gemma2Config(
        **GEMMA,
        sliding_window=WINDOW,
        query_pre_attn_scalar=20,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3": lambda: T.Gemma3TextConfig(
        **{**GEMMA, "num_hidden_layers": 3},
        sliding_window=WINDOW,
        query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    "qwen3": lambda: T.Qwen3Config(**LLAMA_LIKE, head_dim=24),
    "mistral-window": lambda: T.MistralConfig(**LLAMA_LIKE, sliding_window=WINDOW),
    "qwen2-window-layers": lambda: T.Qwen2Config(
        **LLAMA_LIKE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "xglm": lambda: T.XGLMConfig(
        vocab_size=VOCAB, d_model=64, num_layers=2, attention_heads=4, ffn_dim=96
    ),
    "mixtral": lambda: T.MixtralConfig(**LLAMA_LIKE, num_local_experts=4, **MOE),
    "qwen3-moe": lambda: T.Qwen3MoeConfig(
        **LLAMA_LIKE, moe_intermediate_size=48, num_experts=4, norm_topk_prob=False, **MOE
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer(None)


def _perturb(model: torch.nn.Module) -> None:
    """Norm weights and biases start at 1 and 0: move them so that a mix-up shows."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)


def _save(name: str, path, tokenizer) -> torch.nn.Module:
    torch.manual_seed(0)
    config = FAMILIES[name]()
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


@torch.no_grad()
def _reference(model) -> tuple[list[torch.Tensor], list[list[int]]]:
    """transformers' prompt log-probs ``[len - 1, vocab]`` and greedy tokens, each prompt alone."""
    logprobs, tokens = [], []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        logits = model(ids).logits[0, :-1].float()
        logprobs.append(torch.log_softmax(logits, dim=-1))
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,
            pad_token_id=0,
        )
        tokens.append(gen[0, ids.shape[1] :].tolist())
    return logprobs, tokens


def _check_prompt_logprobs(output, expected: torch.Tensor) -> None:
    got = output.prompt_logprobs[1:]  # the first token has none
    assert len(got) == expected.shape[0]
    for row, (ours, theirs) in enumerate(zip(got, expected)):
        ids = list(ours)
        values = torch.tensor([float(getattr(ours[i], "logprob", ours[i])) for i in ids])
        torch.testing.assert_close(values, theirs[ids], rtol=1e-4, atol=1e-4, msg=f"row {row}")
        top = set(theirs.topk(TOP).indices.tolist())
        assert len(top & set(ids)) >= TOP - 1, f"row {row}: top tokens differ"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(name, tmp_path, tokenizer):
    model = _save(name, tmp_path, tokenizer)
    ref_logprobs, ref_tokens = _reference(model)
    llm = LLM(str(tmp_path), kv_cache_memory=2 << 20, max_model_len=64, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    first = SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, prompt_logprobs=TOP
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, first, use_tqdm=False)  # batched, different lengths
    assert [o.outputs[0].token_ids for o in outputs] == ref_tokens
    for output, expected in zip(outputs, ref_logprobs):
        _check_prompt_logprobs(output, expected)
    alone = llm.generate(prompts[-1:], greedy, use_tqdm=False)  # a prefix-cache hit too
    assert alone[0].outputs[0].token_ids == ref_tokens[-1]
    again = llm.generate(prompts, greedy, use_tqdm=False)  # prefix-cache hits
    assert any(o.num_cached_tokens > 0 for o in again)
    assert [o.outputs[0].token_ids for o in again] == ref_tokens
    assert_no_leaks(llm)


NO_TRITON = importlib.util.find_spec("triton") is None


@pytest.mark.parametrize(
    "name, backend",
    [
        ("gemma2", "torch"),
        ("mistral-window", "torch"),
        ("mistral-window", "cpp"),
        ("gemma3", "cpp"),
        ("falcon-40b-style", "torch"),
        pytest.param("gemma3", "triton", marks=pytest.mark.skipif(NO_TRITON, reason="triton")),
        pytest.param("phi", "triton", marks=pytest.mark.skipif(NO_TRITON, reason="triton")),
    ],
)
def test_chunked_prefill_and_other_backends(name, backend, tmp_path, tokenizer):
    """Prompt chunks that continue a cached context (windowed, soft-capped), on the torch
    backend, the C++ kernels' (windows in the kernels) and Triton's (interpreted on CPU; the
    eager path for Gemma 3's local layers)."""
    model = _save(name, tmp_path, tokenizer)
    _, ref_tokens = _reference(model)
    llm = LLM(
        str(tmp_path),
        kv_cache_memory=2 << 20,
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
        attention_backend=backend,
    )
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == ref_tokens
    assert_no_leaks(llm)


def test_unsupported_architecture_lists_supported():
    from llmserve.models.registry import get_model_class

    config = T.PretrainedConfig(architectures=["T5ForConditionalGeneration"])
    with pytest.raises(ValueError, match="supported: .*GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class(config)


@pytest.mark.parametrize(
    "arch, config, option",
    [
        ("MptForCausalLM", lambda: T.MptConfig(attn_config={"clip_qkv": 8.0}), "clip_qkv"),
        ("FalconForCausalLM", lambda: T.FalconConfig(**BLOOM_LIKE, alibi=True), "alibi"),
        (
            "GPT2LMHeadModel",
            lambda: T.GPT2Config(**GPT, scale_attn_by_inverse_layer_idx=True),
            "inverse_layer_idx",
        ),
        (
            "Qwen3MoeForCausalLM",
            lambda: T.Qwen3MoeConfig(**LLAMA_LIKE, decoder_sparse_step=2),
            "decoder_sparse_step",
        ),
    ],
)
def test_unsupported_option_is_named(arch, config, option):
    from llmserve.models.registry import get_model_class

    config = config()
    config.architectures = [arch]
    with pytest.raises(ValueError, match=f"unsupported configuration: .*{option}"):
        get_model_class(config)(config, 64)


def test_unsupported_rope_type_is_named():
    from llmserve.models.phi3 import Phi3ForCausalLM

    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    config = T.Phi3Config(**LLAMA_LIKE, pad_token_id=0, rope_parameters=scaling)
    with pytest.raises(ValueError, match="longrope"):
        Phi3ForCausalLM(config, 64)


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA3_GGUF_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _write_gguf(path: str, arch: str, model: torch.nn.Module) -> None:
    """As llama.cpp's converter writes Qwen3 or Gemma 3 (norm weights stored as 1 + w)."""
    import gguf

    config, is_gemma = model.config, arch == "gemma3"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope["full_attention"] if is_gemma else rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if is_gemma:
        writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(config.vocab_size)
    names = _GEMMA3_GGUF_NAMES if is_gemma else _GGUF_LAYER_NAMES
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, weight in model.state_dict().items():
        parts = name.split(".")
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if parts[1] == "layers":
            module = ".".join(parts[3:]).removesuffix(".weight")
            gguf_name = f"blk.{parts[2]}.{names[module]}.weight"
        else:
            gguf_name = top[name.removesuffix(".weight")] + ".weight"
        values = weight + 1 if is_gemma and name.endswith("norm.weight") else weight
        writer.add_tensor(gguf_name, values.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GGUF_CONFIGS = {
    # GGUF keeps no query_pre_attn_scalar: head_dim is assumed, as for all Gemma 3 but the 27B
    "gemma3": lambda: T.Gemma3TextConfig(
        **{**GEMMA, "num_hidden_layers": 7}, sliding_window=WINDOW, query_pre_attn_scalar=24
    ),
    "qwen3": lambda: T.Qwen3Config(**LLAMA_LIKE, head_dim=24),
}
GGUF_FIELDS = ("head_dim", "num_key_value_heads", "layer_types", "tie_word_embeddings")


@pytest.mark.parametrize("arch", list(GGUF_CONFIGS))
def test_gguf_config_and_tensors(arch, tmp_path):
    """The GGUF reader rebuilds the config (Gemma 3: 6-layer local/global pattern, two RoPE
    bases, window) and the tensors in Hugging Face form (Gemma's norms back to w)."""
    from llmserve.loader.gguf_loader import iter_gguf_tensors, load_gguf_config

    config = GGUF_CONFIGS[arch]()
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(path, arch, model)
    ours = load_gguf_config(path)
    assert ours.architectures == [type(model).__name__]
    for field in GGUF_FIELDS:
        assert getattr(ours, field) == getattr(config, field), field
    if arch == "gemma3":
        assert ours.rope_parameters == config.rope_parameters
        assert (ours.sliding_window, ours.query_pre_attn_scalar) == (WINDOW, 24)
    tensors = dict(iter_gguf_tensors(path))
    expected = model.state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert tensors.keys() == expected.keys()
    for name, weight in expected.items():
        torch.testing.assert_close(tensors[name], weight, msg=name)

"""Tier 3 on tiny random models: Llama (GQA, MQA, RoPE scaling types), Mistral, Qwen2 (q/k/v
bias), tied and separate LM heads, loaded from Hugging Face directories (sharded
safetensors too). Greedy outputs must equal transformers' token for token.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from llmserve import LLM, SamplingParams
from llmserve.layers.rotary import compute_inv_freq, rope_parameters
from tests.conftest import assert_no_leaks

PROMPTS = ["Hello there", "SELECT name FROM users WHERE", "1, 2, 3, 4,"]
NUM_TOKENS = 12
SMALL = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _rope(kind: str) -> dict:
    scalings = {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    }
    return {"rope_scaling": scalings[kind]} if kind in scalings else {}


CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(**SMALL, num_key_value_heads=2),
    "llama-mqa-tied": lambda: LlamaConfig(
        **{**SMALL, "tie_word_embeddings": True}, num_key_value_heads=1
    ),
    "llama-mha-linear": lambda: LlamaConfig(**SMALL, num_key_value_heads=4, **_rope("linear")),
    "llama-dynamic": lambda: LlamaConfig(**SMALL, num_key_value_heads=2, **_rope("dynamic")),
    "llama3-rope": lambda: LlamaConfig(**SMALL, num_key_value_heads=2, **_rope("llama3")),
    "llama-yarn": lambda: LlamaConfig(**SMALL, num_key_value_heads=2, **_rope("yarn")),
    "mistral": lambda: MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=None),
    "qwen2-bias": lambda: Qwen2Config(**SMALL, num_key_value_heads=2),
}


@pytest.fixture(scope="module")
def tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer(None)


def _save_model(name: str, path, tokenizer, shard: bool = False):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if name == "qwen2-bias":  # random init leaves biases at zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(path, max_shard_size="2MB" if shard else "5GB")
    tokenizer.save_pretrained(path)
    return model.eval()


def _reference(model, tokenizer) -> list[list[int]]:
    outs = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,
            pad_token_id=0,
        )
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(name, tmp_path, tokenizer):
    model = _save_model(name, tmp_path, tokenizer, shard=name == "llama-gqa")
    if name == "llama-gqa":
        assert len(list(tmp_path.glob("*.safetensors"))) > 1  # sharded checkpoint
    expected = _reference(model, tokenizer)
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, max_model_len=128, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    assert_no_leaks(llm)


@pytest.mark.parametrize("kind", ["default", "linear", "llama3", "yarn"])
def test_rope_frequencies_match_transformers(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**SMALL, num_key_value_heads=2, **_rope(kind))
    ours, our_scale = compute_inv_freq(
        rope_parameters(config), 16, config.max_position_embeddings, 256
    )
    if kind == "default":
        theirs = 1.0 / (
            rope_parameters(config)["rope_theta"] ** (torch.arange(0, 16, 2).double() / 16)
        )
        their_scale = 1.0
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-5, atol=1e-7)
    assert our_scale == pytest.approx(their_scale)

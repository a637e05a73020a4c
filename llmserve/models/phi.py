"""Phi (phi-1, phi-1.5, phi-2): partial rotary, one LayerNorm feeding attention and MLP in
parallel, biases everywhere, an LM head with bias."""

from __future__ import annotations

from typing import Any

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules, require, rope_config


class PhiForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"model\.layers\.",
        {
            "input_layernorm": "attn_norm",
            "self_attn.q_proj": "self_attn.qkv_proj#q",
            "self_attn.k_proj": "self_attn.qkv_proj#k",
            "self_attn.v_proj": "self_attn.qkv_proj#v",
            "self_attn.dense": "self_attn.o_proj",
            "mlp.fc1": "mlp.up_proj",
            "mlp.fc2": "mlp.down_proj",
        },
        {
            r"model\.embed_tokens": "embed_tokens",
            r"model\.final_layernorm": "norm",
            "lm_head": "lm_head",
        },
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        require(not config.qk_layernorm, "qk_layernorm")
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        kv_heads = config.num_key_value_heads or heads
        attn = AttentionConfig(
            hidden, heads, kv_heads, head_dim, True, True, rope=rope_config(config, head_dim)
        )
        mlp = MLPConfig(config.intermediate_size, config.hidden_act, False, True)
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.num_hidden_layers,
            mlp=[mlp] * config.num_hidden_layers,
            norm_eps=config.layer_norm_eps,
            layout="parallel",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            lm_head_bias=True,
        )

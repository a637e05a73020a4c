"""XGLM: fixed sinusoidal positions (looked up at p + 2), embeddings scaled by sqrt(d_model)."""

from __future__ import annotations

from typing import Any

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules


class XGLMForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"model\.layers\.",
        {
            "self_attn_layer_norm": "attn_norm",
            "final_layer_norm": "mlp_norm",
            "self_attn.q_proj": "self_attn.qkv_proj#q",
            "self_attn.k_proj": "self_attn.qkv_proj#k",
            "self_attn.v_proj": "self_attn.qkv_proj#v",
            "self_attn.out_proj": "self_attn.o_proj",
            "fc1": "mlp.up_proj",
            "fc2": "mlp.down_proj",
        },
        {
            r"model\.embed_tokens": "embed_tokens",
            r"model\.layer_norm": "norm",
            "lm_head": "lm_head",
        },
        skip=(r"model\.embed_positions\.weights",),
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        hidden, heads = config.d_model, config.attention_heads
        attn = AttentionConfig(hidden, heads, heads, hidden // heads, True, True)
        mlp = MLPConfig(config.ffn_dim, config.activation_function, False, True)
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.num_layers,
            mlp=[mlp] * config.num_layers,
            embed_scale=hidden**0.5 if config.scale_embedding else None,
            positions="sinusoidal",
            max_positions=config.max_position_embeddings,
            position_offset=2,
            tie_word_embeddings=getattr(config, "tie_word_embeddings", True),
        )

"""Phi-3 (and Phi-4-mini): Llama with checkpoint-fused ``qkv_proj`` and ``gate_up_proj``,
partial rotary, an optional sliding window."""

from __future__ import annotations

from typing import Any

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import (
    LLAMA_LAYER_PARTS,
    LLAMA_TOP,
    DecoderSpec,
    MLPConfig,
    rename_rules,
    rope_config,
)


class Phi3ForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"model\.layers\.",
        {
            **LLAMA_LAYER_PARTS,
            "self_attn.qkv_proj": "self_attn.qkv_proj",
            "mlp.gate_up_proj": "mlp.gate_up_proj",
        },
        LLAMA_TOP,
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        rope = rope_config(config, head_dim)
        window = getattr(config, "sliding_window", None)
        attn = AttentionConfig(
            hidden, heads, config.num_key_value_heads, head_dim, rope=rope, sliding_window=window
        )
        mlp = MLPConfig(config.intermediate_size, config.hidden_act, True)
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.num_hidden_layers,
            mlp=[mlp] * config.num_hidden_layers,
            norm="rms",
            norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

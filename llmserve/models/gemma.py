"""Gemma, Gemma 2 and Gemma 3 (text): GeGLU MLP, (1 + w) RMSNorm, embeddings scaled by
sqrt(hidden), a tied LM head.

    Gemma 2  + pre/post norms around attention and MLP ("sandwich"), sliding-window layers
               alternating with global ones, attention and final logit soft-capping,
               scale query_pre_attn_scalar ** -0.5
    Gemma 3  + q/k RMSNorm, 5 local : 1 global layers, each kind with its own RoPE base
"""

from __future__ import annotations

from typing import Any

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import (
    LLAMA_LAYER_PARTS,
    LLAMA_TOP,
    DecoderSpec,
    MLPConfig,
    layer_windows,
    rename_rules,
    rope_config,
)

_SANDWICH_PARTS = {
    **LLAMA_LAYER_PARTS,
    "post_attention_layernorm": "attn_out_norm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "mlp_out_norm",
}


def _activation(config: Any) -> str:
    return getattr(config, "hidden_activation", None) or config.hidden_act


def _gemma_spec(config: Any, attention: list[AttentionConfig], sandwich: bool) -> DecoderSpec:
    mlp = MLPConfig(config.intermediate_size, _activation(config), True)
    return DecoderSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        attention=attention,
        mlp=[mlp] * config.num_hidden_layers,
        norm="gemma_rms",
        norm_eps=config.rms_norm_eps,
        layout="sandwich" if sandwich else "pre",
        embed_scale=config.hidden_size**0.5,
        tie_word_embeddings=getattr(config, "tie_word_embeddings", True),
        final_softcap=getattr(config, "final_logit_softcapping", None),
    )


def _attention(config: Any, window: int | None, layer_type: str | None, **extra):
    head_dim = config.head_dim
    return AttentionConfig(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim,
        qkv_bias=getattr(config, "attention_bias", False),
        rope=rope_config(config, head_dim, layer_type),
        sliding_window=window,
        **extra,
    )


class GemmaForCausalLM(DecoderLM):
    RENAMES = rename_rules(r"model\.layers\.", LLAMA_LAYER_PARTS, LLAMA_TOP)

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        attn = _attention(config, None, None)
        return _gemma_spec(config, [attn] * config.num_hidden_layers, sandwich=False)


class Gemma2ForCausalLM(DecoderLM):
    RENAMES = rename_rules(r"model\.layers\.", _SANDWICH_PARTS, LLAMA_TOP)

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        extra = dict(
            scale=config.query_pre_attn_scalar**-0.5, softcap=config.attn_logit_softcapping
        )
        attention = [_attention(config, w, None, **extra) for w in layer_windows(config)]
        return _gemma_spec(config, attention, sandwich=True)


class Gemma3ForCausalLM(DecoderLM):
    RENAMES = rename_rules(r"model\.layers\.", _SANDWICH_PARTS, LLAMA_TOP)

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        extra = dict(
            scale=config.query_pre_attn_scalar**-0.5,
            softcap=getattr(config, "attn_logit_softcapping", None),
            qk_norm="gemma_rms",
            qk_norm_eps=config.rms_norm_eps,
        )
        types = config.layer_types
        attention = [
            _attention(config, w, kind, **extra) for w, kind in zip(layer_windows(config), types)
        ]
        return _gemma_spec(config, attention, sandwich=True)

"""Mixtral: Mistral's attention (GQA, sliding window) with a top-2 mixture of SwiGLU experts."""

from __future__ import annotations

from typing import Any

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import (
    LLAMA_LAYER_PARTS,
    LLAMA_TOP,
    DecoderSpec,
    MoEConfig,
    rename_rules,
    rope_config,
)

_EXPERTS = r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)"


class MixtralForCausalLM(DecoderLM):
    RENAMES = [
        (rf"{_EXPERTS}\.w1\.weight", r"layers.\1.mlp.w13#\2:gate"),
        (rf"{_EXPERTS}\.w3\.weight", r"layers.\1.mlp.w13#\2:up"),
        (rf"{_EXPERTS}\.w2\.weight", r"layers.\1.mlp.w2#\2"),
        (r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight", r"layers.\1.mlp.gate.weight"),
        *rename_rules(r"model\.layers\.", LLAMA_LAYER_PARTS, LLAMA_TOP),
    ]

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        attn = AttentionConfig(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            rope=rope_config(config, head_dim),
            sliding_window=getattr(config, "sliding_window", None),
        )
        moe = MoEConfig(
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            True,
            config.hidden_act,
        )
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            attention=[attn] * config.num_hidden_layers,
            mlp=[moe] * config.num_hidden_layers,
            norm="rms",
            norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

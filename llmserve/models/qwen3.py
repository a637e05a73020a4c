"""Qwen3 and Qwen3-MoE: Llama with per-head q/k RMSNorm; the MoE variant routes each token to
``num_experts_per_tok`` of ``num_experts`` SwiGLU experts (dense MLPs in ``mlp_only_layers``)."""

from __future__ import annotations

from typing import Any

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import (
    LLAMA_LAYER_PARTS,
    LLAMA_TOP,
    DecoderSpec,
    MLPConfig,
    MoEConfig,
    layer_windows,
    rename_rules,
    require,
    rope_config,
)


def _qwen3_spec(config: Any, mlp: list[MLPConfig | MoEConfig]) -> DecoderSpec:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    windows = layer_windows(config) if getattr(config, "use_sliding_window", False) else None
    attention = [
        AttentionConfig(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            qkv_bias=getattr(config, "attention_bias", False),
            rope=rope_config(config, head_dim),
            sliding_window=None if windows is None else windows[i],
            qk_norm="rms",
            qk_norm_eps=config.rms_norm_eps,
        )
        for i in range(config.num_hidden_layers)
    ]
    return DecoderSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        attention=attention,
        mlp=mlp,
        norm="rms",
        norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


class Qwen3ForCausalLM(DecoderLM):
    RENAMES = rename_rules(r"model\.layers\.", LLAMA_LAYER_PARTS, LLAMA_TOP)

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        mlp = MLPConfig(config.intermediate_size, config.hidden_act, True)
        return _qwen3_spec(config, [mlp] * config.num_hidden_layers)


class Qwen3MoeForCausalLM(DecoderLM):
    RENAMES = [
        (
            r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight",
            r"layers.\1.mlp.w13#\2:gate",
        ),
        (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight", r"layers.\1.mlp.w13#\2:up"),
        (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", r"layers.\1.mlp.w2#\2"),
        (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"layers.\1.mlp.gate.weight"),
        *rename_rules(r"model\.layers\.", LLAMA_LAYER_PARTS, LLAMA_TOP),
    ]

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        require(
            config.decoder_sparse_step == 1, f"decoder_sparse_step={config.decoder_sparse_step}"
        )
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        moe = MoEConfig(
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            config.hidden_act,
        )
        mlp = [
            MLPConfig(config.intermediate_size, config.hidden_act, True) if i in dense else moe
            for i in range(config.num_hidden_layers)
        ]
        return _qwen3_spec(config, mlp)

"""GPT-NeoX / Pythia: partial rotary (``partial_rotary_factor``, neox pairs), parallel residual
with two norms (or sequential), fused query_key_value stored per head as [q, k, v]."""

from __future__ import annotations

from typing import Any

import torch

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.bloom import heads_interleaved_to_qkv
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules, rope_config


class GPTNeoXForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"gpt_neox\.layers\.",
        {
            "input_layernorm": "attn_norm",
            "post_attention_layernorm": "mlp_norm",
            "attention.query_key_value": "self_attn.qkv_proj",
            "attention.dense": "self_attn.o_proj",
            "mlp.dense_h_to_4h": "mlp.up_proj",
            "mlp.dense_4h_to_h": "mlp.down_proj",
        },
        {
            r"gpt_neox\.embed_in": "embed_tokens",
            r"gpt_neox\.final_layer_norm": "norm",
            "embed_out": "lm_head",
        },
        skip=(r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",),
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        bias = getattr(config, "attention_bias", True)
        attn = AttentionConfig(
            hidden, heads, heads, head_dim, bias, bias, rope=rope_config(config, head_dim)
        )
        mlp = MLPConfig(config.intermediate_size, config.hidden_act, False, True)
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.num_hidden_layers,
            mlp=[mlp] * config.num_hidden_layers,
            norm_eps=config.layer_norm_eps,
            layout="parallel2" if config.use_parallel_residual else "pre",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def convert(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        if "query_key_value" in hf_name:
            return heads_interleaved_to_qkv(tensor, self.config.num_attention_heads)
        return tensor

"""BLOOM: ALiBi (no position embeddings), a LayerNorm right after the token embedding, fused
query_key_value stored per head as [q, k, v]."""

from __future__ import annotations

from typing import Any

import torch

from llmserve.layers.position import alibi_slopes
from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules, require


def heads_interleaved_to_qkv(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows ``[H, 3, D]`` (each head's q, k, v together) -> ``[3, H, D]`` (all q, all k, all v)."""
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


class BloomForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"(?:transformer\.)?h\.",
        {
            "input_layernorm": "attn_norm",
            "post_attention_layernorm": "mlp_norm",
            "self_attention.query_key_value": "self_attn.qkv_proj",
            "self_attention.dense": "self_attn.o_proj",
            "mlp.dense_h_to_4h": "mlp.up_proj",
            "mlp.dense_4h_to_h": "mlp.down_proj",
        },
        {
            r"(?:transformer\.)?word_embeddings": "embed_tokens",
            r"(?:transformer\.)?word_embeddings_layernorm": "embed_norm",
            r"(?:transformer\.)?ln_f": "norm",
            "lm_head": "lm_head",
        },
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        require(
            not config.apply_residual_connection_post_layernorm,
            "apply_residual_connection_post_layernorm",
        )
        hidden, heads = config.hidden_size, config.n_head
        slopes = alibi_slopes(heads, order="bloom")
        attn = AttentionConfig(
            hidden, heads, heads, hidden // heads, True, True, alibi_slopes=slopes
        )
        mlp = MLPConfig(4 * hidden, "gelu_new", False, True)  # bloom_gelu is the tanh form
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.n_layer,
            mlp=[mlp] * config.n_layer,
            norm_eps=config.layer_norm_epsilon,
            embed_norm=True,
            tie_word_embeddings=getattr(config, "tie_word_embeddings", True),
        )

    def convert(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        if "query_key_value" in hf_name:
            return heads_interleaved_to_qkv(tensor, self.config.n_head)
        return tensor

"""Falcon: RoPE, parallel attention + MLP. Three q|k|v layouts in ``query_key_value``:

new_decoder_architecture (40b, 180b, GQA):  per KV group [q x G, k, v]   ln_attn + ln_mlp
multi_query (7b, MQA):                      [all q, k, v]                input_layernorm
neither:                                    per head [q, k, v]
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.bloom import heads_interleaved_to_qkv
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules, require, rope_config


def _kv_heads(config: Any) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"(?:transformer\.)?h\.",
        {
            "input_layernorm": "attn_norm",
            "ln_attn": "attn_norm",
            "ln_mlp": "mlp_norm",
            "post_attention_layernorm": "mlp_norm",
            "self_attention.query_key_value": "self_attn.qkv_proj",
            "self_attention.dense": "self_attn.o_proj",
            "mlp.dense_h_to_4h": "mlp.up_proj",
            "mlp.dense_4h_to_h": "mlp.down_proj",
        },
        {
            r"(?:transformer\.)?word_embeddings": "embed_tokens",
            r"(?:transformer\.)?ln_f": "norm",
            "lm_head": "lm_head",
        },
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        require(not config.alibi, "alibi (falcon-rw)")
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        attn = AttentionConfig(
            hidden,
            heads,
            _kv_heads(config),
            head_dim,
            config.bias,
            config.bias,
            rope=rope_config(config, head_dim),
        )
        mlp = MLPConfig(config.ffn_hidden_size or 4 * hidden, config.activation, False, config.bias)
        if config.new_decoder_architecture:
            two_norms = (config.num_ln_in_parallel_attn or 2) == 2
            layout = "parallel2" if two_norms else "parallel"
        else:
            layout = "parallel" if config.parallel_attn else "pre"
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.num_hidden_layers,
            mlp=[mlp] * config.num_hidden_layers,
            norm_eps=config.layer_norm_epsilon,
            layout=layout,
            tie_word_embeddings=getattr(config, "tie_word_embeddings", True),
        )

    def convert(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        if "query_key_value" not in hf_name:
            return tensor
        config = self.config
        if not config.new_decoder_architecture:
            if config.multi_query:
                return tensor
            return heads_interleaved_to_qkv(tensor, config.num_attention_heads)
        kv_heads = config.num_kv_heads
        group = config.num_attention_heads // kv_heads
        rest = tensor.shape[1:]
        grouped = tensor.reshape(kv_heads, group + 2, -1, *rest)  # [kvh, G + 2, D, ...]
        q = grouped[:, :group].reshape(-1, *rest)
        k, v = grouped[:, group].reshape(-1, *rest), grouped[:, group + 1].reshape(-1, *rest)
        return torch.cat([q, k, v])

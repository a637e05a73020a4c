"""MPT: ALiBi (MPT's slope order), LayerNorm without bias when ``no_bias``, exact-GELU MLP."""

from __future__ import annotations

from typing import Any

from llmserve.layers.position import alibi_slopes
from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules, require


class MptForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"transformer\.blocks\.",
        {
            "norm_1": "attn_norm",
            "norm_2": "mlp_norm",
            "attn.Wqkv": "self_attn.qkv_proj",
            "attn.out_proj": "self_attn.o_proj",
            "ffn.up_proj": "mlp.up_proj",
            "ffn.down_proj": "mlp.down_proj",
        },
        {r"transformer\.wte": "embed_tokens", r"transformer\.norm_f": "norm", "lm_head": "lm_head"},
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        a = config.attn_config
        require(a.alibi, "attn_config.alibi=False (learned positions)")
        require(a.clip_qkv is None, "attn_config.clip_qkv")
        require(not a.qk_ln, "attn_config.qk_ln")
        require(not a.prefix_lm, "attn_config.prefix_lm")
        hidden, heads, bias = config.d_model, config.n_heads, not config.no_bias
        head_dim = hidden // heads
        attn = AttentionConfig(
            hidden,
            heads,
            heads,
            head_dim,
            bias,
            bias,
            scale=a.softmax_scale,
            alibi_slopes=alibi_slopes(heads, a.alibi_bias_max, order="mpt"),
        )
        mlp = MLPConfig(config.expansion_ratio * hidden, "gelu", False, bias)
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.n_layers,
            mlp=[mlp] * config.n_layers,
            norm_eps=config.layer_norm_epsilon,
            norm_bias=bias,
            tie_word_embeddings=getattr(config, "tie_word_embeddings", True),
        )

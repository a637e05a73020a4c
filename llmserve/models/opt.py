"""OPT: learned positions looked up at p + 2, ReLU MLP; pre-LN, or post-LN with narrower
embeddings projected in and out (opt-350m: ``do_layer_norm_before=False``, ``project_in/out``)."""

from __future__ import annotations

from typing import Any

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules, require


class OPTForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"(?:model\.)?decoder\.layers\.",
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
            r"(?:model\.)?decoder\.embed_tokens": "embed_tokens",
            r"(?:model\.)?decoder\.embed_positions": "embed_positions",
            r"(?:model\.)?decoder\.final_layer_norm": "norm",
            r"(?:model\.)?decoder\.project_in": "project_in",
            r"(?:model\.)?decoder\.project_out": "project_out",
            "lm_head": "lm_head",
        },
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        require(config.layer_norm_elementwise_affine, "layer_norm_elementwise_affine=False")
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.enable_bias
        attn = AttentionConfig(hidden, heads, heads, hidden // heads, qkv_bias=bias, out_bias=bias)
        mlp = MLPConfig(config.ffn_dim, config.activation_function, False, bias)
        pre = config.do_layer_norm_before
        project = config.word_embed_proj_dim
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.num_hidden_layers,
            mlp=[mlp] * config.num_hidden_layers,
            layout="pre" if pre else "post",
            positions="learned",
            max_positions=config.max_position_embeddings + 2,
            position_offset=2,
            final_norm=pre and not getattr(config, "_remove_final_layer_norm", False),
            project_dim=project if project != hidden else None,
            tie_word_embeddings=getattr(config, "tie_word_embeddings", True),
        )

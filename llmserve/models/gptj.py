"""GPT-J: partial rotary on adjacent channel pairs, one LayerNorm feeding attention and MLP in
parallel, an LM head with bias."""

from __future__ import annotations

from typing import Any

from llmserve.layers.self_attention import AttentionConfig, RopeConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules


class GPTJForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"transformer\.h\.",
        {
            "ln_1": "attn_norm",
            "attn.q_proj": "self_attn.qkv_proj#q",
            "attn.k_proj": "self_attn.qkv_proj#k",
            "attn.v_proj": "self_attn.qkv_proj#v",
            "attn.out_proj": "self_attn.o_proj",
            "mlp.fc_in": "mlp.up_proj",
            "mlp.fc_out": "mlp.down_proj",
        },
        {r"transformer\.wte": "embed_tokens", r"transformer\.ln_f": "norm", "lm_head": "lm_head"},
        skip=(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",),
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        hidden, heads = config.n_embd, config.n_head
        head_dim = hidden // heads
        rope = RopeConfig(
            config.rotary_dim or head_dim,
            {"rope_theta": 10000.0, "rope_type": "default"},
            config.n_positions,
            is_neox=False,
        )
        attn = AttentionConfig(hidden, heads, heads, head_dim, rope=rope)
        mlp = MLPConfig(config.n_inner or 4 * hidden, config.activation_function, False, True)
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.n_layer,
            mlp=[mlp] * config.n_layer,
            norm_eps=config.layer_norm_epsilon,
            layout="parallel",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            lm_head_bias=True,
        )

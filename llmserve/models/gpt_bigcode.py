"""GPTBigCode / StarCoder: GPT-2 with multi-query attention (one K/V head) and nn.Linear weights."""

from __future__ import annotations

from typing import Any

import torch

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.bloom import heads_interleaved_to_qkv
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules, require


class GPTBigCodeForCausalLM(DecoderLM):
    RENAMES = rename_rules(
        r"transformer\.h\.",
        {
            "ln_1": "attn_norm",
            "ln_2": "mlp_norm",
            "attn.c_attn": "self_attn.qkv_proj",
            "attn.c_proj": "self_attn.o_proj",
            "mlp.c_fc": "mlp.up_proj",
            "mlp.c_proj": "mlp.down_proj",
        },
        {
            r"transformer\.wte": "embed_tokens",
            r"transformer\.wpe": "embed_positions",
            r"transformer\.ln_f": "norm",
            "lm_head": "lm_head",
        },
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        require(config.scale_attn_weights, "scale_attn_weights=False")
        require(not getattr(config, "add_cross_attention", False), "add_cross_attention")
        hidden, heads = config.n_embd, config.n_head
        kv_heads = 1 if config.multi_query else heads
        attn = AttentionConfig(hidden, heads, kv_heads, hidden // heads, True, True)
        mlp = MLPConfig(config.n_inner or 4 * hidden, config.activation_function, False, True)
        return DecoderSpec(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            attention=[attn] * config.n_layer,
            mlp=[mlp] * config.n_layer,
            norm_eps=config.layer_norm_epsilon,
            positions="learned",
            max_positions=config.n_positions,
            tie_word_embeddings=getattr(config, "tie_word_embeddings", True),
        )

    def convert(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        if "c_attn" in hf_name and not self.config.multi_query:
            return heads_interleaved_to_qkv(tensor, self.config.n_head)
        return tensor

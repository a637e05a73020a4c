"""GPT-2: learned absolute positions, LayerNorm, GELU (tanh) MLP, Conv1D weights ([in, out])."""

from __future__ import annotations

from typing import Any

import torch

from llmserve.layers.self_attention import AttentionConfig
from llmserve.models.decoder import DecoderLM
from llmserve.models.decoder_spec import DecoderSpec, MLPConfig, rename_rules, require

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2LMHeadModel(DecoderLM):
    RENAMES = rename_rules(
        r"(?:transformer\.)?h\.",
        {
            "ln_1": "attn_norm",
            "ln_2": "mlp_norm",
            "attn.c_attn": "self_attn.qkv_proj",
            "attn.c_proj": "self_attn.o_proj",
            "mlp.c_fc": "mlp.up_proj",
            "mlp.c_proj": "mlp.down_proj",
        },
        {
            r"(?:transformer\.)?wte": "embed_tokens",
            r"(?:transformer\.)?wpe": "embed_positions",
            r"(?:transformer\.)?ln_f": "norm",
            r"lm_head": "lm_head",
        },
        skip=(r"(?:transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",),
    )

    @classmethod
    def build_spec(cls, config: Any) -> DecoderSpec:
        require(not config.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx")
        require(config.scale_attn_weights, "scale_attn_weights=False")
        require(not getattr(config, "add_cross_attention", False), "add_cross_attention")
        hidden, heads = config.n_embd, config.n_head
        attn = AttentionConfig(hidden, heads, heads, hidden // heads, qkv_bias=True, out_bias=True)
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
        return tensor.T if hf_name.endswith(_CONV1D) else tensor

    def row_order(self, hf_name: str, num_rows: int) -> torch.Tensor | None:
        """Quantized Conv1D weights come ``[out, in]`` like a Linear's (GPTQ/AWQ tools and
        llama.cpp transpose them before packing): nothing to move."""
        return None

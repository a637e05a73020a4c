"""Hugging Face configs of the GGUF families in gguf_families.py, built from a GGUF file's
metadata (``GGUFMeta``: llama.cpp's keys, tensor shapes, special token ids). The converters
write every family's feed-forward width as 4 * hidden, whatever the model has, so the width
is read from the ``ffn_down`` tensor instead."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import (
    BloomConfig,
    FalconConfig,
    GPT2Config,
    GPTBigCodeConfig,
    GPTJConfig,
    GPTNeoXConfig,
    MptConfig,
    PhiConfig,
    PretrainedConfig,
)


@dataclass(frozen=True)
class GGUFMeta:
    """A GGUF file's metadata and tensor shapes (HF order), as the config builders need them."""

    arch: str
    field: Callable[[str, Any], Any]  # (full key, default) -> value
    tensor_shapes: dict[str, tuple[int, ...]]
    token_ids: dict[str, int]

    def get(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks the required key {self.arch}.{key!r}")
        return value

    def has(self, tensor_name: str) -> bool:
        return tensor_name in self.tensor_shapes

    def common(self) -> dict[str, int | float | bool]:
        """hidden, layers, heads, kv_heads, context, ffn (from ffn_down), vocab, eps, tied."""
        heads = int(self.need("attention.head_count"))
        vocab = self.get("vocab_size") or self.tensor_shapes["token_embd.weight"][0]
        ffn_down = self.tensor_shapes.get("blk.0.ffn_down.weight")
        return dict(
            hidden=int(self.need("embedding_length")),
            layers=int(self.need("block_count")),
            heads=heads,
            kv_heads=int(self.get("attention.head_count_kv", heads)),
            context=int(self.get("context_length", 2048)),
            ffn=int(ffn_down[1] if ffn_down else self.need("feed_forward_length")),
            vocab=int(vocab),
            eps=float(self.get("attention.layer_norm_epsilon", 1e-5)),
            tied=not self.has("output.weight"),
        )


def gpt2_config(meta: GGUFMeta, config_cls: type = GPT2Config, **extra: Any) -> PretrainedConfig:
    c = meta.common()
    return config_cls(
        vocab_size=c["vocab"],
        n_embd=c["hidden"],
        n_layer=c["layers"],
        n_head=c["heads"],
        n_positions=c["context"],
        n_inner=c["ffn"],
        layer_norm_epsilon=c["eps"],
        tie_word_embeddings=c["tied"],
        **extra,
        **meta.token_ids,
    )


def starcoder_config(meta: GGUFMeta) -> PretrainedConfig:
    kv_heads = int(meta.get("attention.head_count_kv", 1))
    if kv_heads != 1 and kv_heads != int(meta.need("attention.head_count")):
        raise ValueError(f"starcoder GGUF: {kv_heads} kv heads; GPTBigCode has 1 or all")
    return gpt2_config(
        meta, GPTBigCodeConfig, multi_query=kv_heads == 1, activation_function="gelu_pytorch_tanh"
    )


def gptj_config(meta: GGUFMeta) -> PretrainedConfig:
    head_dim = int(meta.need("embedding_length")) // int(meta.need("attention.head_count"))
    rotary_dim = int(meta.get("rope.dimension_count", head_dim))
    return gpt2_config(meta, GPTJConfig, rotary_dim=rotary_dim)


def bloom_config(meta: GGUFMeta) -> PretrainedConfig:
    c = meta.common()
    return BloomConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        n_layer=c["layers"],
        n_head=c["heads"],
        layer_norm_epsilon=c["eps"],
        tie_word_embeddings=c["tied"],
        **meta.token_ids,
    )


def falcon_config(meta: GGUFMeta) -> PretrainedConfig:
    """llama.cpp runs Falcon 7B (one norm, multi-query) and 40B/180B (two norms, kv groups),
    both with parallel attention and no ALiBi."""
    c = meta.common()
    is_new = meta.has("blk.0.attn_norm_2.weight")
    return FalconConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_kv_heads=c["kv_heads"],
        new_decoder_architecture=is_new,
        multi_query=not is_new and c["kv_heads"] == 1,
        parallel_attn=True,
        alibi=False,
        bias=meta.has("blk.0.attn_qkv.bias"),
        ffn_hidden_size=c["ffn"],
        max_position_embeddings=c["context"],
        layer_norm_epsilon=c["eps"],
        tie_word_embeddings=c["tied"],
        **meta.token_ids,
    )


def _rotary_fraction(meta: GGUFMeta, head_dim: int) -> float:
    return int(meta.get("rope.dimension_count", head_dim)) / head_dim


def gptneox_config(meta: GGUFMeta) -> PretrainedConfig:
    c = meta.common()
    return GPTNeoXConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        intermediate_size=c["ffn"],
        max_position_embeddings=c["context"],
        rotary_pct=_rotary_fraction(meta, c["hidden"] // c["heads"]),
        rotary_emb_base=float(meta.get("rope.freq_base", 10000.0)),
        use_parallel_residual=bool(meta.get("use_parallel_residual", True)),
        layer_norm_eps=c["eps"],
        tie_word_embeddings=c["tied"],
        **meta.token_ids,
    )


def phi2_config(meta: GGUFMeta) -> PretrainedConfig:
    c = meta.common()
    return PhiConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        intermediate_size=c["ffn"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        max_position_embeddings=c["context"],
        partial_rotary_factor=_rotary_fraction(meta, c["hidden"] // c["heads"]),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        layer_norm_eps=c["eps"],
        tie_word_embeddings=c["tied"],
        **meta.token_ids,
    )


def mpt_config(meta: GGUFMeta) -> PretrainedConfig:
    c = meta.common()
    if c["ffn"] % c["hidden"]:
        raise ValueError(f"mpt GGUF: feed-forward width {c['ffn']} is not a multiple of hidden")
    alibi_max = float(meta.get("attention.max_alibi_bias", 0.0))
    attn_config = dict(
        alibi=alibi_max > 0,
        alibi_bias_max=int(alibi_max or 8),
        clip_qkv=meta.get("attention.clamp_kqv"),
        kv_n_heads=c["kv_heads"],
    )
    return MptConfig(
        vocab_size=c["vocab"],
        d_model=c["hidden"],
        n_layers=c["layers"],
        n_heads=c["heads"],
        max_seq_len=c["context"],
        expansion_ratio=c["ffn"] // c["hidden"],
        no_bias=not meta.has("blk.0.attn_qkv.bias"),
        layer_norm_epsilon=c["eps"],
        attn_config=attn_config,
        tie_word_embeddings=c["tied"],
        **meta.token_ids,
    )

"""What a family file hands the generic decoder (``decoder.py``): its config read into a
``DecoderSpec`` (attention and MLP per layer, norms, residual layout, embeddings), and the
helpers that build one: checkpoint renames (``rename_rules``, Llama's names), RoPE per layer
type, sliding windows per layer, refusing what the decoder would get wrong (``require``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmserve.layers.rotary import rope_parameters
from llmserve.layers.self_attention import AttentionConfig, RopeConfig

LAYOUTS = ("pre", "post", "parallel", "parallel2", "sandwich")


@dataclass
class MLPConfig:
    intermediate_size: int
    act: str
    gated: bool
    bias: bool = False


@dataclass
class MoEConfig:
    intermediate_size: int
    num_experts: int
    top_k: int
    normalize_top_k: bool
    act: str = "silu"


@dataclass
class DecoderSpec:
    """Everything the generic decoder needs; per-layer lists for attention and MLP."""

    vocab_size: int
    hidden_size: int
    attention: list[AttentionConfig]
    mlp: list[MLPConfig | MoEConfig]
    norm: str = "layer"  # layer | rms | gemma_rms
    norm_eps: float = 1e-5
    norm_bias: bool = True
    layout: str = "pre"
    embed_scale: float | None = None  # token embeddings times this (Gemma, XGLM)
    positions: str = "none"  # absolute positions at the embedding: none | learned | sinusoidal
    max_positions: int = 0
    position_offset: int = 0  # OPT and XGLM look positions up at p + 2
    embed_norm: bool = False  # a norm right after the embedding (BLOOM)
    final_norm: bool = True
    project_dim: int | None = None  # OPT-350m: embeddings narrower than hidden, projected
    tie_word_embeddings: bool = True
    lm_head_bias: bool = False
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)


def rename_rules(
    layer_prefix: str, layer_parts: dict[str, str], top: dict[str, str], skip: tuple[str, ...] = ()
) -> list[tuple[str, str | None]]:
    """``RENAMES`` from module maps: ``{"attn.c_attn": "self_attn.qkv_proj"}`` under
    ``layer_prefix`` + layer index (ours may end in ``#part``), ``top`` for the rest (regexes);
    ``skip``: regexes of checkpoint tensors we do not use."""
    rules: list[tuple[str, str | None]] = [(pattern, None) for pattern in skip]
    for hf, ours in layer_parts.items():
        module, _, part = ours.partition("#")
        suffix = f"#{part}" if part else ""
        rules.append(
            (rf"{layer_prefix}(\d+)\.{hf}\.(weight|bias)", rf"layers.\1.{module}.\2{suffix}")
        )
    for hf, ours in top.items():
        rules.append((rf"{hf}\.(weight|bias)", rf"{ours}.\1"))
    return rules


# Llama-style checkpoint names, shared by the families that kept them (Gemma, Qwen3, Mixtral...).
LLAMA_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
    "self_attn.q_proj": "self_attn.qkv_proj#q",
    "self_attn.k_proj": "self_attn.qkv_proj#k",
    "self_attn.v_proj": "self_attn.qkv_proj#v",
    "self_attn.o_proj": "self_attn.o_proj",
    "self_attn.q_norm": "self_attn.q_norm",
    "self_attn.k_norm": "self_attn.k_norm",
    "mlp.gate_proj": "mlp.gate_up_proj#gate",
    "mlp.up_proj": "mlp.gate_up_proj#up",
    "mlp.down_proj": "mlp.down_proj",
}
LLAMA_TOP = {r"model\.embed_tokens": "embed_tokens", r"model\.norm": "norm", "lm_head": "lm_head"}


def rope_config(
    config: Any, head_dim: int, layer_type: str | None = None, is_neox: bool = True
) -> RopeConfig:
    """RoPE from ``rope_parameters`` (per layer type where a config keys it so, as Gemma 3),
    ``rope_theta`` / ``rope_scaling``, and ``partial_rotary_factor``."""
    nested = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in nested:
        params = dict(nested[layer_type])
        params.setdefault("rope_theta", 10000.0)
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    else:
        params = rope_parameters(config)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    return RopeConfig(rotary_dim, params, config.max_position_embeddings, is_neox)


def layer_windows(config: Any) -> list[int | None]:
    """Per layer: the sliding window, or None for full attention (``layer_types``)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    for kind in set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"unsupported configuration: layer type {kind!r}")
    return [window if kind == "sliding_attention" else None for kind in types]


def require(condition: bool, message: str) -> None:
    """Refuse a config option this implementation would silently get wrong."""
    if not condition:
        raise ValueError(f"unsupported configuration: {message}")

"""Per-architecture config extras of the GGUF architectures named like Llama (Gemma 2 and 3,
Phi-3, Qwen3-MoE, Mixtral): what each reads from its `{arch}.*` metadata beyond the shared
keys, and what llama.cpp leaves out of the file but fixes in code."""

from typing import Any

from llmserve.loader.gguf_file import GGUFFile


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def required(reader: GGUFFile, key: str) -> Any:
    value = field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks the required key {key!r}")
    return value


def feed_forward_length(reader: GGUFFile, arch: str) -> int:
    """`{arch}.feed_forward_length`, else the width of layer 0's ffn_down (MoE: experts')."""
    value = field(reader, f"{arch}.feed_forward_length")
    if value is not None:
        return int(value[0] if isinstance(value, list) else value)
    for tensor in reader.tensors:
        if tensor.name in ("blk.0.ffn_down.weight", "blk.0.ffn_down_exps.weight"):
            return int(tensor.shape[0])
    raise ValueError(f"GGUF metadata lacks the required key '{arch}.feed_forward_length'")


def moe_config(reader: GGUFFile, arch: str) -> dict[str, Any]:
    """Mixtral's expert counts (llama.cpp's llama architecture with experts)."""
    return dict(
        num_local_experts=int(required(reader, f"{arch}.expert_count")),
        num_experts_per_tok=int(required(reader, f"{arch}.expert_used_count")),
    )


def qwen3moe_config(reader: GGUFFile, arch: str, kwargs: dict) -> dict[str, Any]:
    """Experts of every layer; llama.cpp normalizes the top-k weights unless told not to."""
    return dict(
        moe_intermediate_size=int(required(reader, f"{arch}.expert_feed_forward_length")),
        num_experts=int(required(reader, f"{arch}.expert_count")),
        num_experts_per_tok=int(required(reader, f"{arch}.expert_used_count")),
        norm_topk_prob=bool(field(reader, f"{arch}.expert_weights_norm", True)),
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def gemma2_config(reader: GGUFFile, arch: str, kwargs: dict) -> dict[str, Any]:
    """Soft-caps and the window from the file; the attention scale is not stored: as llama.cpp,
    1/sqrt(head_dim), except the 27B's 1/sqrt(hidden / heads). Even layers are local."""
    is_27b = kwargs["hidden_size"] == 4608 and kwargs["num_hidden_layers"] == 46
    return dict(
        query_pre_attn_scalar=(
            kwargs["hidden_size"] // kwargs["num_attention_heads"] if is_27b else kwargs["head_dim"]
        ),
        sliding_window=int(required(reader, f"{arch}.attention.sliding_window")),
        attn_logit_softcapping=field(reader, f"{arch}.attn_logit_softcapping"),
        final_logit_softcapping=field(reader, f"{arch}.final_logit_softcapping"),
    )


def phi3_config(reader: GGUFFile, arch: str, kwargs: dict) -> dict[str, Any]:
    """Partial rotary, the window (0: none) and the pre-extension context length."""
    if any(t.name.startswith("rope_factors_") for t in reader.tensors):
        raise ValueError("phi3 GGUF with LongRoPE factors (128k-context models) is not supported")
    head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    window = field(reader, f"{arch}.attention.sliding_window") or None
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    return dict(
        partial_rotary_factor=int(field(reader, f"{arch}.rope.dimension_count", head_dim))
        / head_dim,
        sliding_window=None if window is None else int(window),
        original_max_position_embeddings=int(original or kwargs["max_position_embeddings"]),
    )


EXTRA_CONFIG = {"gemma2": gemma2_config, "phi3": phi3_config, "qwen3moe": qwen3moe_config}


def gemma3_config(
    reader: GGUFFile, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> dict[str, Any]:
    """Gemma 3's extras: head_dim, the sliding window, and RoPE per layer kind (llama.cpp
    keeps only the global base; local layers use 10000, and every sixth layer is global).
    The attention scale is not stored either: as llama.cpp, 1/sqrt(head_dim), except the
    27B's 1/sqrt(hidden / heads)."""
    head_dim = int(required(reader, "gemma3.attention.key_length"))
    hidden = int(required(reader, "gemma3.embedding_length"))
    heads = int(required(reader, "gemma3.attention.head_count"))
    is_27b = hidden == 5376 and int(required(reader, "gemma3.block_count")) == 62
    global_rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    return dict(
        head_dim=head_dim,
        query_pre_attn_scalar=hidden // heads if is_27b else head_dim,
        sliding_window=int(required(reader, "gemma3.attention.sliding_window")),
        rope_parameters={
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )

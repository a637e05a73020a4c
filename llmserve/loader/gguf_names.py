"""GGUF tensor names -> Hugging Face parameter names: llama.cpp's ``blk.{i}.attn_q.weight``
is Llama's ``model.layers.{i}.self_attn.q_proj.weight``; other architectures differ from
Llama's names in a few parts (below), and the families of gguf_families.py have names of
their own."""

from __future__ import annotations

import re

from llmserve.loader.gguf_families import FAMILIES

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per architecture, where its tensors differ from llama's. "{expert}": one tensor per expert.
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_SANDWICH_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_MIXTRAL_EXPERTS = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
}
_ARCH_LAYER_TENSOR_NAMES = {
    "llama": _MIXTRAL_EXPERTS,
    "mistral": _MIXTRAL_EXPERTS,
    "qwen3": _QK_NORMS,
    "gemma2": _SANDWICH_NORMS,
    "gemma3": {**_QK_NORMS, **_SANDWICH_NORMS},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen3moe": {
        **_QK_NORMS,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
        "ffn_up_exps": "mlp.experts.{expert}.up_proj",
        "ffn_down_exps": "mlp.experts.{expert}.down_proj",
    },
}
# Tensors with no Hugging Face parameter: llama3-style rope frequency factors.
_SKIPPED_TENSORS = {"rope_freqs.weight"}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Map a GGUF tensor name to its Hugging Face name (None: no HF counterpart). Expert
    tensors map to a name with an ``{expert}`` field, one tensor per expert."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    if arch in FAMILIES:
        return _family_tensor_name(gguf_name, arch)
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSOR_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSOR_NAMES[base]}.{suffix}"
    names = {**_LAYER_TENSOR_NAMES, **_ARCH_LAYER_TENSOR_NAMES.get(arch, {})}
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{names[part]}.{suffix}"


def _family_tensor_name(gguf_name: str, arch: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match is None:
        name = FAMILIES[arch].hf_name(None, base, suffix)
    else:
        name = FAMILIES[arch].hf_name(*match.groups())
    if name is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name ({arch})")
    return name

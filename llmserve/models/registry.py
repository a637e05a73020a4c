"""Architecture name (``config.architectures[0]``) -> model class. One line per architecture."""

from __future__ import annotations

from typing import Any

from torch import nn

from llmserve.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(config: Any) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {architectures}; supported: {sorted(MODEL_REGISTRY)}"
    )

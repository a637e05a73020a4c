"""The float model to quantize: any checkpoint llmserve reads (Hugging Face directory or GGUF,
dequantized to float32), held in a transformers model whose module names are the checkpoint's.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from llmserve.loader import ResolvedModel, iter_weights


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Checkpoint prefix (``model.layers.0.self_attn.q_proj``) -> module, for every linear
    layer inside the decoder layers (embeddings and the LM head are not quantized)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("model.layers.")
    }


def empty_model(hf_config) -> nn.Module:
    """The architecture on the meta device (shapes only, no memory), for checks."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def load_float_model(resolved: ResolvedModel, hf_config) -> nn.Module:
    """The transformers model with the checkpoint's weights, float32, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    state = {name: t.float() for name, t in iter_weights(resolved) if "rotary_emb" not in name}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(hf_config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"{resolved.display_name}: checkpoint does not match its architecture "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    return model


def generation_config(resolved: ResolvedModel, hf_config):
    """The checkpoint's generation_config.json, or one derived from the model config."""
    from transformers import GenerationConfig

    if resolved.kind == "hf" and os.path.isfile(
        os.path.join(resolved.path, "generation_config.json")
    ):
        return GenerationConfig.from_pretrained(resolved.path, local_files_only=True)
    return GenerationConfig.from_model_config(hf_config)

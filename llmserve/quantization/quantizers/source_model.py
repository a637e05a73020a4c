"""The float model to quantize: any checkpoint llmserve reads (Hugging Face directory or GGUF,
dequantized to float32), held in a transformers model whose module names are the checkpoint's.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from llmserve.loader import ResolvedModel, iter_weights

# Architectures whose decoder layers ``decoder_stages.py`` runs (Llama's modules, rotate-half
# RoPE, Qwen3's q/k norms): gptq and awq run these stage by stage; other families go through
# ``replay.py`` (gptq) and ``awq_replay.py`` (awq); rtn needs no layer code.
CALIBRATED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(checkpoint prefix ``model.layers`` / ``transformer.h`` / ..., the layers) of any
    transformers causal LM: the module list with one entry per hidden layer."""
    count = model.config.num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and name:
            return name, module
    raise ValueError(f"{type(model).__name__}: no list of {count} decoder layers found")


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D: a linear layer whose weight is stored ``[in, out]``."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` weight of an ``nn.Linear`` or a Conv1D (transposed, as AutoGPTQ,
    gptqmodel and llama.cpp pack it)."""
    weight = module.weight.data
    return weight.T if is_conv1d(module) else weight


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Checkpoint prefix (``model.layers.0.self_attn.q_proj``, ``transformer.h.0.attn.c_attn``)
    -> module, for every linear layer (``nn.Linear`` or Conv1D) inside the decoder layers
    (embeddings, the LM head and stacked expert tensors are not quantized)."""
    prefix, _ = decoder_layers(model)
    return {
        name: module
        for name, module in model.named_modules()
        if (isinstance(module, nn.Linear) or is_conv1d(module)) and name.startswith(prefix + ".")
    }


def empty_model(hf_config) -> nn.Module:
    """The architecture on the meta device (shapes only, no memory), for checks."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def load_float_model(resolved: ResolvedModel, hf_config) -> nn.Module:
    """The transformers model with the checkpoint's weights, float32, in eval mode (loaded
    through ``from_pretrained``, which renames what this transformers version names its own
    way, e.g. GPT-NeoX's ``embed_out`` -> ``lm_head``)."""
    state = {name: t.float() for name, t in iter_weights(resolved) if "rotary_emb" not in name}
    model, info = type(empty_model(hf_config)).from_pretrained(
        None, config=hf_config, state_dict=state, dtype=torch.float32, output_loading_info=True
    )
    missing, unexpected = info["missing_keys"], info["unexpected_keys"]
    if getattr(hf_config, "tie_word_embeddings", False):
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected or info.get("mismatched_keys"):
        raise ValueError(
            f"{resolved.display_name}: checkpoint does not match its architecture "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    return model.float().eval()


def checkpoint_names(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict:
    """``model``'s state-dict entries under the checkpoint's names (as ``save_pretrained``;
    transformers before 5 renames nothing)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    return revert_weight_conversion(model, tensors)


def generation_config(resolved: ResolvedModel, hf_config):
    """The checkpoint's generation_config.json, or one derived from the model config."""
    from transformers import GenerationConfig

    if resolved.kind == "hf" and os.path.isfile(
        os.path.join(resolved.path, "generation_config.json")
    ):
        return GenerationConfig.from_pretrained(resolved.path, local_files_only=True)
    return GenerationConfig.from_model_config(hf_config)

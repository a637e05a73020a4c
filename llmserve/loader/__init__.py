"""Find a model on disk and read its config and weights, whether GGUF or Hugging Face.

resolve_model("x.gguf" | "hf_dir/" | "dir_with_one.gguf/" | None)  -> ResolvedModel
load_config(resolved)   -> transformers PretrainedConfig
iter_weights(resolved)  -> (HF parameter name, tensor), one at a time
"""

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import PretrainedConfig

from llmserve.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from llmserve.loader.gguf_loader import iter_gguf_tensors, load_gguf_config
from llmserve.loader.hf_loader import iter_hf_tensors, load_hf_config

__all__ = [
    "ResolvedModel",
    "default_model_path",
    "iter_weights",
    "load_config",
    "resolve_model",
]


@dataclass(frozen=True)
class ResolvedModel:
    """A model located on disk."""

    kind: Literal["gguf", "hf"]
    """"gguf": one llama.cpp GGUF file; "hf": a Hugging Face directory with config.json."""
    path: str
    """The model directory (for GGUF: the folder holding the file), as transformers takes it."""
    gguf_file: str | None
    """The GGUF file name inside `path`; None for "hf"."""
    display_name: str
    """The name to report (e.g. as the OpenAI `model` field)."""

    @property
    def weights_path(self) -> str:
        """The GGUF file itself, or the Hugging Face directory."""
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path


def _gguf_model(file_path: str, display_name: str) -> ResolvedModel:
    folder, name = os.path.split(os.path.abspath(file_path))
    return ResolvedModel("gguf", folder, name, display_name)


def resolve_model(model: str | None) -> ResolvedModel:
    """Locate `model`: None (the default SmolLM2 GGUF), a .gguf file, a Hugging Face directory
    (with config.json), or a directory holding exactly one .gguf file."""
    if model is None:
        return _gguf_model(default_model_path(), DEFAULT_MODEL_NAME)
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _gguf_model(path, model)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ResolvedModel("hf", os.path.abspath(path), None, model)
        gguf_files = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if len(gguf_files) == 1:
            return _gguf_model(os.path.join(path, gguf_files[0]), model)
        if len(gguf_files) > 1:
            raise ValueError(
                f"Model directory {model!r} holds {len(gguf_files)} .gguf files "
                f"({', '.join(gguf_files)}); pass the path of one of them"
            )
    raise ValueError(
        f"Cannot find model {model!r}: expected a .gguf file, a Hugging Face directory "
        "containing config.json, or a directory containing exactly one .gguf file "
        "(or no model, for the default SmolLM2-135M-Instruct)"
    )


def load_config(resolved: ResolvedModel) -> PretrainedConfig:
    """The model's transformers config."""
    if resolved.kind == "gguf":
        return load_gguf_config(resolved.weights_path)
    return load_hf_config(resolved.path)


# generation_config.json's sampling fields -> SamplingParams' (vLLM's --generation-config auto)
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(resolved: ResolvedModel, setting: str = "auto") -> dict[str, Any]:
    """The sampling fields a request leaves unset take from the model: ``auto`` reads the
    model directory's generation_config.json (the fields its authors set), ``vllm`` none of
    it, anything else names a directory holding such a file. GGUF files carry none."""
    if setting == "vllm" or (setting == "auto" and resolved.kind != "hf"):
        return {}
    path = os.path.join(resolved.path if setting == "auto" else setting, "generation_config.json")
    if not os.path.isfile(path):
        if setting == "auto":
            return {}
        raise ValueError(
            f"generation_config {setting!r}: expected auto, vllm, or a directory holding a "
            "generation_config.json"
        )
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    return {ours: saved[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if theirs in saved}


def iter_weights(resolved: ResolvedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, tensor) pairs; GGUF tensors come dequantized to fp32."""
    if resolved.kind == "gguf":
        return iter_gguf_tensors(resolved.weights_path)
    return iter_hf_tensors(resolved.path)

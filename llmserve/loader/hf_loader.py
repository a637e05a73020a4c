"""Read a Hugging Face model directory: config.json and safetensors (or pytorch_model*.bin)."""

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig


def load_hf_config(model_dir: str) -> PretrainedConfig:
    """Load `config.json` from a local directory (never the Hub)."""
    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def _indexed_files(model_dir: str, index_name: str) -> list[str] | None:
    """Shard files named by a `*.index.json` weight map, in order; None if there is no index."""
    index_path = os.path.join(model_dir, index_name)
    if not os.path.isfile(index_path):
        return None
    with open(index_path) as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]


def weight_files(model_dir: str) -> tuple[str, list[str]]:
    """Return ("safetensors" | "bin", files) for the checkpoint in `model_dir`.

    Safetensors win over pickled `.bin` files when both are present.
    """
    for fmt, index_name, pattern in (
        ("safetensors", "model.safetensors.index.json", "*.safetensors"),
        ("bin", "pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        files = _indexed_files(model_dir, index_name)
        if files is None:
            files = sorted(glob.glob(os.path.join(model_dir, pattern)))
        if files:
            return fmt, files
    raise ValueError(
        f"No weights in {model_dir}: looked for *.safetensors (or model.safetensors.index.json) "
        "and pytorch_model*.bin (or pytorch_model.bin.index.json)"
    )


def iter_hf_tensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, in its stored dtype."""
    fmt, files = weight_files(model_dir)
    for path in files:
        if fmt == "safetensors":
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state_dict.items()

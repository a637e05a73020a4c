"""A PEFT adapter's tensors placed on this model's linear layers.

PEFT names each pair after the Hugging Face module it adapts:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]

llmserve fuses some of those modules (q, k and v into ``qkv_proj``; gate and up into
``gate_up_proj``) and may store their rows in another order (q/k per head for the rotary
kernel). The model's own ``quantized_placement`` (which quantized checkpoints use for the same
question) says where the module's rows go; each adapted part of a fused layer adds its A rows
to the layer's stacked A and its B (scaled) to a block of the layer's B:

    qkv_proj:  A = [A_q; A_k; A_v]            [3r, in]
               B = [B_q  0    0  ]  q rows    [out, 3r]
                   [0    B_k  0  ]  k rows
                   [0    0    B_v]  v rows
"""

from __future__ import annotations

import os
import re

import torch

from llmserve.lora.request import WEIGHT_FILES, LoRARequest, check_rank, read_adapter_config

_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
NOT_ADAPTABLE = ("embed_tokens.weight", "lm_head.weight", "embed_positions.weight")

Pair = tuple[torch.Tensor, torch.Tensor]  # A^T [in, R], s B^T [R, out]


def load_adapter(
    model: torch.nn.Module,
    request: LoRARequest,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Pair]:
    """Our module name (``layers.0.self_attn.qkv_proj``) -> its (A^T, s B^T); ValueError with
    what is wrong where the adapter does not fit this model."""
    path = request.lora_path
    config = read_adapter_config(path, max_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(
                f"adapter {path!r}: tensor {key!r} is not a LoRA A/B weight of a linear "
                "layer (PEFT saves whole layers beside an adapter of the embeddings or the LM "
                "head); LoRA runs on the attention and MLP projections"
            )
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for hf_module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {path!r}: {hf_module} has lora_{set(pair).pop()} only")
        a, b = pair["A"].float(), pair["B"].float()
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(
                f"adapter {path!r}: {hf_module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                "LoRA needs A [r, in] and B [out, r]"
            )
        check_rank(rank, max_rank, path)
        name, offset, b = _place(model, path, hf_module, b)
        parts.setdefault(name, []).append((offset, a, b * config.scaling(hf_module, rank)))
    if not parts:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    return {name: _stack(model, path, name, p, dtype, device) for name, p in parts.items()}


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = (os.path.join(path, name) for name in WEIGHT_FILES)
    if os.path.isfile(safetensors_file):
        from safetensors.torch import load_file

        return load_file(safetensors_file)
    return torch.load(bin_file, map_location="cpu", weights_only=True)


def _place(
    model: torch.nn.Module, path: str, hf_module: str, b: torch.Tensor
) -> tuple[str, int, torch.Tensor]:
    """(our module, the first of its output rows ``b`` fills, ``b`` in our row order)."""
    try:
        name, shard, order = model.quantized_placement(f"{hf_module}.weight", b.shape[0])
    except ValueError as e:
        raise ValueError(f"adapter {path!r}: {hf_module} is no layer of this model ({e})") from e
    if name is None or name.endswith(NOT_ADAPTABLE) or ".experts" in name:
        raise ValueError(
            f"adapter {path!r} adapts {hf_module}; LoRA runs on the attention and MLP "
            "projections (not embeddings, the LM head or mixture-of-experts experts)"
        )
    module = name.removesuffix(".weight")
    rows = model.get_submodule(module).out_features
    offset = 0
    if shard is not None:
        sizes = model.shard_sizes(name)
        offset, rows = sum(sizes[:shard]), sizes[shard]
    if b.shape[0] != rows:
        raise ValueError(
            f"adapter {path!r}: {hf_module}'s lora_B has {b.shape[0]} rows; the model's layer "
            f"has {rows} (an adapter of another base model?)"
        )
    return module, offset, b if order is None else b[order]


def _stack(
    model: torch.nn.Module,
    path: str,
    name: str,
    parts: list[tuple[int, torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> Pair:
    layer = model.get_submodule(name)
    total = sum(a.shape[0] for _, a, _ in parts)
    a_t = torch.zeros(layer.in_features, total)
    b_t = torch.zeros(total, layer.out_features)
    start = 0
    for offset, a, b in parts:
        if a.shape[1] != layer.in_features:
            raise ValueError(
                f"adapter {path!r}: {name}'s lora_A takes {a.shape[1]} inputs; the model's "
                f"layer takes {layer.in_features} (an adapter of another base model?)"
            )
        rank = a.shape[0]
        a_t[:, start : start + rank] = a.T
        b_t[start : start + rank, offset : offset + b.shape[0]] = b.T
        start += rank
    return a_t.to(device, dtype).contiguous(), b_t.to(device, dtype).contiguous()

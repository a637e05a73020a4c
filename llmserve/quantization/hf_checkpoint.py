"""Read a GPTQ or AWQ Hugging Face checkpoint: quantized linear layers as ``QuantizedWeight``.

A quantized layer ``P`` is stored as ``P.qweight``, ``P.qzeros``, ``P.scales`` (and, for
GPTQ, ``P.g_idx``); every other tensor (norms, embeddings, the LM head, biases) is float and
passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from llmserve.loader.hf_loader import iter_hf_tensors
from llmserve.quantization.layout import QuantizedWeight

QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def iter_gptq_awq(model_dir: str, spec) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, tensor) for float tensors; (``P.weight``, ``QuantizedWeight``) per layer P."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_hf_tensors(model_dir):
        suffix = next((s for s in QUANT_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
        else:
            layers.setdefault(name.removesuffix(suffix), {})[suffix[1:]] = tensor
    for prefix, parts in layers.items():
        yield prefix + ".weight", _convert(prefix, parts, spec)


def _convert(prefix: str, parts: dict[str, torch.Tensor], spec) -> QuantizedWeight:
    required = ("qweight", "qzeros", "scales")
    missing = [name for name in required if name not in parts]
    if missing:
        raise ValueError(
            f"{spec.method.upper()} layer {prefix} lacks {', '.join(missing)} "
            f"(a quantized layer needs {', '.join(required)})"
        )
    if spec.method == "gptq":
        from llmserve.quantization.gptq import gptq_to_internal

        return gptq_to_internal(
            parts["qweight"],
            parts["qzeros"],
            parts["scales"],
            parts.get("g_idx"),
            bits=spec.bits,
            group_size=spec.group_size,
            desc_act=spec.desc_act,
            sym=spec.sym,
            checkpoint_format=spec.checkpoint_format,
            layer_name=prefix,
        )
    from llmserve.quantization.awq import awq_to_internal

    return awq_to_internal(
        parts["qweight"],
        parts["qzeros"],
        parts["scales"],
        bits=spec.bits,
        group_size=spec.group_size,
        layer_name=prefix,
    )

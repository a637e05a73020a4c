"""Write a quantized Hugging Face checkpoint in the layouts GPTQ and AWQ loaders read.

    GPTQ v1 (rtn, gptq)   P.qweight int32 [K * bits / 32, N]   codes packed along K
                          P.qzeros  int32 [K / G, N * bits / 32] zero - 1, packed along N
                          P.scales  fp16  [K / G, N]
                          P.g_idx   int32 [K]
    AWQ gemm (awq)        P.qweight int32 [K, N / 8]   nibble i of word c: column 8c + ORDER[i]
                          P.qzeros  int32 [K / G, N / 8]   same packing, zero itself
                          P.scales  fp16  [K / G, N]        ORDER = 0 2 4 6 1 3 5 7

Packing "along" a dimension: the int32 words form one little-endian bit stream and value i
takes bits [i * bits, (i + 1) * bits) (3 bits: 32 values in 3 words, some values split
between two words). Everything else (embeddings, norms, LM head, biases) is stored fp16.

The directory is written under a temporary name beside ``output`` and renamed at the end, so
an interrupted run leaves no half checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any

import torch

from llmserve.quantization.quantizers.rtn import QuantResult

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
WEIGHTS_FILE = "model.safetensors"


def pack_int32_stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers ``[R, C]`` in 0..2^bits-1 -> int32 ``[R * bits / 32, C]``, packed along R."""
    rows, cols = values.shape
    common = math.gcd(bits, 32)
    cycle_words, cycle_values = bits // common, 32 // common  # 3 bits: 3 words hold 32 values
    assert rows % cycle_values == 0, (rows, bits)
    v = values.to(torch.int64).reshape(rows // cycle_values, cycle_values, cols)
    words = torch.zeros(rows // cycle_values, cycle_words, cols, dtype=torch.int64)
    for j in range(cycle_values):
        word, shift = divmod(j * bits, 32)
        words[:, word] |= (v[:, j] << shift) & 0xFFFFFFFF
        if shift + bits > 32:  # the value's high bits start the next word
            words[:, word + 1] |= v[:, j] >> (32 - shift)
    words = words.reshape(-1, cols)  # [R * bits / 32, C] as unsigned 32-bit numbers
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_tensors(result: QuantResult) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of one layer (zero stored minus one)."""
    stored_zeros = result.zeros - 1  # [N, num_groups]
    assert int(stored_zeros.min()) >= 0, "GPTQ v1 cannot store a zero point of 0"
    return {
        "qweight": pack_int32_stream(result.codes.T, result.bits),  # [K * b / 32, N]
        "qzeros": pack_int32_stream(stored_zeros, result.bits).T.contiguous(),  # [G, N * b/32]
        "scales": result.scales.T.contiguous().half(),  # [num_groups, N]
        "g_idx": result.g_idx.to(torch.int32),
    }


def awq_tensors(result: QuantResult) -> dict[str, torch.Tensor]:
    """AWQ gemm tensors of one layer (4-bit, groups in column order)."""
    assert result.bits == 4
    return {
        "qweight": _pack_awq(result.codes.T),  # [K, N / 8]
        "qzeros": _pack_awq(result.zeros.T),  # [K / G, N / 8]
        "scales": result.scales.T.contiguous().half(),  # [K / G, N]
    }


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` -> int32 ``[R, N / 8]`` with AWQ's interleaved nibble order."""
    rows, n = values.shape
    order = torch.tensor(AWQ_ORDER)
    interleaved = values.reshape(rows, n // 8, 8)[:, :, order].reshape(rows, n)
    return pack_int32_stream(interleaved.T, 4).T.contiguous()


def write_checkpoint(
    output: str,
    tensors: dict[str, torch.Tensor],
    config,
    quantization_config: dict[str, Any],
    tokenizer,
    generation_config,
    overwrite: bool,
) -> None:
    """Write ``tensors`` (already packed) with config.json (plus ``quantization_config``),
    the tokenizer and generation_config.json into ``output``, atomically."""
    from safetensors.torch import save_file

    output = os.path.abspath(output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    temporary = os.path.join(parent, f".{os.path.basename(output)}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        os.makedirs(temporary)
        save_file(tensors, os.path.join(temporary, WEIGHTS_FILE), metadata={"format": "pt"})
        _write_config(temporary, config, quantization_config)
        tokenizer.save_pretrained(temporary)
        if generation_config is not None:
            generation_config.save_pretrained(temporary)
        if os.path.exists(output):
            if not overwrite:
                raise ValueError(f"output {output!r} appeared while quantizing; not replaced")
            shutil.rmtree(output)
        os.rename(temporary, output)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _write_config(directory: str, config, quantization_config: dict[str, Any]) -> None:
    config.save_pretrained(directory)
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    raw["quantization_config"] = quantization_config
    raw["dtype"] = raw["torch_dtype"] = "float16"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2, sort_keys=True)
    if quantization_config["quant_method"] == "gptq":  # AutoGPTQ / gptqmodel also read this
        with open(os.path.join(directory, "quantize_config.json"), "w", encoding="utf-8") as f:
            json.dump(quantization_config, f, indent=2)

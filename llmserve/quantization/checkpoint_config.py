"""Which pre-quantized format (GPTQ, AWQ) a Hugging Face checkpoint directory holds.

Looked for, in this order (the first found wins):

    config.json["quantization_config"]   transformers (GPTQConfig / AwqConfig), gptqmodel, AutoAWQ
    quantize_config.json                 AutoGPTQ / gptqmodel       (no quant_method: "gptq")
    quant_config.json                    AutoAWQ                    (no quant_method: "awq")

Key synonyms accepted: bits / w_bit, group_size / q_group_size, GPTQ checkpoint_format / format,
AWQ version / format (transformers 5 writes ``format``; ``backend`` there only picks a kernel).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

GPTQ_BITS = (2, 3, 4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
SUPPORTED_METHODS = ("gptq", "awq")
_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))
_NOT_SUPPORTED_HINTS = {
    "bitsandbytes": "pre-quantized bitsandbytes checkpoints are not supported",
    "fp8": "pre-quantized fp8 checkpoints are not supported",
    "fbgemm_fp8": "pre-quantized fp8 checkpoints are not supported",
    "compressed-tensors": "compressed-tensors checkpoints are not supported",
}


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a GPTQ or AWQ checkpoint's linear weights are quantized."""

    method: Literal["gptq", "awq"]
    """The quantization method, from ``quant_method``."""
    bits: int
    """Bits per weight: GPTQ 2, 3, 4 or 8; AWQ 4."""
    group_size: int
    """Input columns sharing one scale and zero; -1 = one group over all input columns."""
    desc_act: bool = False
    """GPTQ act-order: groups follow ``g_idx`` rather than column order."""
    sym: bool = True
    """GPTQ symmetric quantization (zero point at the middle of the range)."""
    checkpoint_format: Literal["gptq", "gptq_v2"] = "gptq"
    """GPTQ zero-point storage: "gptq" stores zero - 1, "gptq_v2" the zero itself."""
    version: Literal["gemm"] = "gemm"
    """AWQ kernel layout the weights are packed for (only AutoAWQ's GEMM)."""
    zero_point: bool = True
    """AWQ asymmetric quantization with stored zeros (the only kind supported)."""
    modules_to_not_convert: tuple[str, ...] | None = None
    """Module names left unquantized (AWQ's ``modules_to_not_convert``), or None."""
    quantized_lm_head: bool = False
    """gptqmodel ``lm_head: true``: the output projection is quantized too."""


def read_checkpoint_quantization(model_dir: str) -> CheckpointQuantization | None:
    """The quantization of the Hugging Face checkpoint in ``model_dir``; None if unquantized.

    Raises ValueError for a quantization llmserve cannot read, naming what is allowed.
    """
    config_path = os.path.join(model_dir, "config.json")
    if os.path.isfile(config_path):
        raw = _read_json(config_path).get("quantization_config")
        if raw is not None:
            return parse_quantization_config(raw, source=config_path)
    for name, default_method in _FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            raw = _read_json(path)
            return parse_quantization_config(raw, source=path, default_method=default_method)
    return None


def parse_quantization_config(
    raw: dict[str, Any], *, source: str = "quantization_config", default_method: str | None = None
) -> CheckpointQuantization:
    """Validate a ``quantization_config`` dict (as in config.json) into a CheckpointQuantization."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: quantization_config must be a JSON object, got {raw!r}")
    method = raw.get("quant_method", default_method)
    method = method.lower() if isinstance(method, str) else method
    if method == "gptq":
        return _parse_gptq(raw, source)
    if method == "awq":
        return _parse_awq(raw, source)
    hint = _NOT_SUPPORTED_HINTS.get(method)
    raise ValueError(
        f"{source}: quant_method={method!r} is not supported; allowed: "
        + ", ".join(repr(m) for m in SUPPORTED_METHODS)
        + (f" ({hint}; load the unquantized model instead)" if hint else "")
    )


def _parse_gptq(raw: dict[str, Any], source: str) -> CheckpointQuantization:
    bits = _get_int(raw, ("bits", "w_bit"), source)
    if bits not in GPTQ_BITS:
        raise ValueError(
            f"{source}: GPTQ bits={bits} is not supported; allowed: "
            + ", ".join(map(str, GPTQ_BITS))
        )
    checkpoint_format = str(raw.get("checkpoint_format", raw.get("format", "gptq"))).lower()
    if raw.get("is_marlin_format"):
        checkpoint_format = "marlin"
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"{source}: GPTQ checkpoint_format={checkpoint_format!r} is not supported; allowed: "
            + ", ".join(repr(f) for f in GPTQ_FORMATS)
            + " (Marlin, BitBLAS and IPEX repacked checkpoints are not)"
        )
    pack_dtype = raw.get("pack_dtype", "int32")
    if str(pack_dtype).removeprefix("torch.") != "int32":
        raise ValueError(
            f"{source}: GPTQ pack_dtype={pack_dtype!r} is not supported; allowed: 'int32'"
        )
    if raw.get("dynamic"):
        raise ValueError(
            f"{source}: GPTQ per-module 'dynamic' overrides are not supported "
            "(every layer must share bits and group_size)"
        )
    return CheckpointQuantization(
        method="gptq",
        bits=bits,
        group_size=_group_size(raw, source),
        desc_act=bool(raw.get("desc_act", False)),
        sym=bool(raw.get("sym", True)),
        checkpoint_format=checkpoint_format,
        quantized_lm_head=bool(raw.get("lm_head", False)),
    )


def _parse_awq(raw: dict[str, Any], source: str) -> CheckpointQuantization:
    bits = _get_int(raw, ("bits", "w_bit"), source, default=4)
    if bits != 4:
        raise ValueError(f"{source}: AWQ bits={bits} is not supported; allowed: 4")
    version = str(raw.get("version", raw.get("format", "gemm"))).lower()
    if str(raw.get("backend")).lower() == "llm-awq":  # transformers < 5 spelled the format so
        version = "llm-awq"
    if version not in AWQ_VERSIONS:
        raise ValueError(
            f"{source}: AWQ version={version!r} is not supported; allowed: 'gemm' (the GEMV, "
            "GEMV-fast, llm-awq, Marlin, ExLlama and IPEX variants are not supported)"
        )
    if not raw.get("zero_point", True):
        raise ValueError(
            f"{source}: AWQ zero_point=false is not supported; allowed: true "
            "(asymmetric AutoAWQ GEMM checkpoints)"
        )
    skipped = raw.get("modules_to_not_convert")
    return CheckpointQuantization(
        method="awq",
        bits=4,
        group_size=_group_size(raw, source),
        sym=False,
        version="gemm",
        zero_point=True,
        modules_to_not_convert=None if skipped is None else tuple(skipped),
    )


def _group_size(raw: dict[str, Any], source: str) -> int:
    group_size = _get_int(raw, ("group_size", "q_group_size"), source, default=128)
    if group_size != -1 and (group_size <= 0 or group_size % 32 != 0):
        raise ValueError(
            f"{source}: group_size={group_size} is not supported; allowed: -1 (one group per "
            "output channel) or a positive multiple of 32"
        )
    return group_size


def _get_int(
    raw: dict[str, Any], keys: tuple[str, ...], source: str, default: int | None = None
) -> int:
    value = next((raw[key] for key in keys if key in raw), default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {keys[0]} must be an integer, got {value!r}")
    return value


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)

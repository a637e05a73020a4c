"""``LoRARequest`` and an adapter directory's config, read and checked before any weight.

Torch-free: the engine (``engine/``) and the server check a request's adapter with it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's fields): ``lora_int_id`` (>= 1) is its
    identity in the engine, ``lora_name`` what the server answers to, ``lora_path`` a PEFT
    adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")


@dataclass(frozen=True)
class AdapterConfig:
    """What llmserve reads of ``adapter_config.json``."""

    alpha: float
    use_rslora: bool
    alpha_pattern: dict[str, float]  # per module (each module's rank comes with its tensors)

    def scaling(self, module_name: str, rank: int) -> float:
        """``alpha / r`` of one module (``alpha / sqrt(r)`` with rsLoRA), its patterns first."""
        alpha = _pattern_value(self.alpha_pattern, module_name, self.alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_adapter_config(path: str, max_rank: int) -> AdapterConfig:
    """The adapter's config; ValueError naming what is wrong and what is allowed."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE} (a PEFT adapter directory)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES):
        raise ValueError(f"LoRA adapter {path!r} has none of {list(WEIGHT_FILES)}")
    with open(config_path) as f:
        raw = json.load(f)
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"adapter {path!r} is a {peft_type} adapter; llmserve runs LORA ones")
    refused = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "modules_to_save (whole layers trained beside the adapter)",
    }
    for key, what in refused.items():
        if raw.get(key):
            raise ValueError(f"adapter {path!r}: {what} are not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"adapter {path!r}: bias {raw['bias']!r} is not supported (only none)")
    ranks = [int(raw.get("r", 8)), *(int(r) for r in (raw.get("rank_pattern") or {}).values())]
    check_rank(max(ranks), max_rank, path)
    return AdapterConfig(
        alpha=float(raw.get("lora_alpha", 8)),
        use_rslora=bool(raw.get("use_rslora", False)),
        alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
    )


def check_rank(rank: int, max_rank: int, path: str) -> None:
    if not 1 <= rank <= max_rank:
        raise ValueError(
            f"adapter {path!r} has rank {rank}; this engine takes ranks 1 to {max_rank} "
            "(raise --max-lora-rank)"
        )


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's pattern lookup: the first key matching the module name's end."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module_name):
            return value
    return default

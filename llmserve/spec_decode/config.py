"""``speculative_config`` as vLLM spells it: a dict (or its JSON) parsed and checked up front.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 3, "quantization": "gguf"}

K (``num_speculative_tokens``) is fixed per request; speculation switches itself off in a
step where more than ``disable_by_batch_size`` sequences decode (large batches are
compute-bound, and verifying K rejected tokens then costs real time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
QUANTIZATIONS = ("int8", "llm_int8", "nf4", "fp4", "gguf")
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "quantization",
    "disable_by_batch_size",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # draft_model: None = the target itself, quantized
    quantization: str | None = None  # draft_model: how the drafter's weights are quantized
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From ``LLM(speculative_config=...)`` or ``--speculative-config``; raises ValueError."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"--speculative-config is not valid JSON ({e.msg} at character {e.pos}): "
                    f'{value!r}; e.g. \'{{"method": "ngram", "num_speculative_tokens": 4}}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a JSON object (a dict), got {type(value).__name__}"
            )
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown}; allowed: {sorted(_KEYS)}"
            )
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {list(METHODS)}, got {method!r}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (K, >= 1)")
        config = cls(**value)
        config._check()
        return config

    def _check(self) -> None:
        def whole(name: str, low: int) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(
                    f"speculative_config {name} must be an integer >= {low}, got {v!r}"
                )
            return v

        whole("num_speculative_tokens", 1)
        whole("disable_by_batch_size", 1)
        if self.method == "ngram":
            low = whole("prompt_lookup_min", 1)
            if whole("prompt_lookup_max", 1) < low:
                raise ValueError(
                    f"speculative_config prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                    f"prompt_lookup_min ({self.prompt_lookup_min})"
                )
            if self.model is not None or self.quantization is not None:
                raise ValueError("speculative_config method ngram takes no model or quantization")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_config quantization must be one of {list(QUANTIZATIONS)} "
                f"(runtime methods; a GPTQ/AWQ drafter is detected from its checkpoint), got "
                f"{self.quantization!r}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config model must be a path, got {self.model!r}")

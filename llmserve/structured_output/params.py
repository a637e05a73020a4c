"""``StructuredOutputsParams``: what a request's output must match (vLLM's field names)."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace",)


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields is set.

    Attributes:
        json: a JSON schema (a dict, or its JSON text); the output is one JSON value valid
            under it.
        regex: the output matches this regular expression (whole output).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in Lark syntax (llguidance's), or GBNF / llama.cpp
            syntax (rules written ``name ::= ...``), whose start rule is ``start`` (Lark)
            or ``root`` (GBNF).
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        disable_any_whitespace: JSON in its compact form (``, `` and ``: `` separators, no
            newlines or indentation), so no tokens go to layout.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json, regex, choice, grammar, "
                f"json_object; got {chosen or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = jsonlib.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}"
            )
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice entries must be non-empty strings")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """One string per distinct constraint (compiled grammars are cached by it)."""
        value = getattr(self, self.kind)
        compact = ":compact" if self.disable_any_whitespace else ""
        return f"{self.kind}{compact}:{jsonlib.dumps(value, sort_keys=True)}"

    @classmethod
    def from_any(
        cls, value: StructuredOutputsParams | dict | None
    ) -> StructuredOutputsParams | None:
        """Accept the dataclass or a plain dict with the same keys (as the API sends)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}"
            )
        unknown = sorted(set(value) - set(KINDS) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown field(s) {unknown}; "
                f"allowed: {', '.join(KINDS + OPTIONS)}"
            )
        return cls(**{k: v for k, v in value.items() if v is not None})

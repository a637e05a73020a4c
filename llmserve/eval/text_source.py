"""Text for calibration and evaluation: the built-in pydoc topics, or a .txt / .jsonl file.

The built-in text is the English documentation that ships with every Python
(``pydoc_data.topics``: the topic pages of ``help()``), joined in sorted topic order with a
blank line between pages, then split once at the first line break after its middle character:

    [ calibration half: quantizers draw samples here | evaluation half: perplexity here ]

A file is used whole for either purpose; .jsonl lines are objects with a "text" field.
"""

from __future__ import annotations

import json
import os
from typing import Literal

PYDOC = "pydoc"
FILE_SUFFIXES = (".txt", ".jsonl")
Split = Literal["calibration", "evaluation"]


def pydoc_text() -> str:
    """Every ``pydoc_data.topics`` page, in sorted topic order, blank-line separated."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def split_text(text: str, split: Split) -> str:
    """The calibration (first) or evaluation (second) half of ``text``, cut at the first line
    break after the middle character (or at the middle when there is none)."""
    middle = len(text) // 2
    cut = text.find("\n", middle)
    cut = middle if cut == -1 else cut + 1
    return text[:cut] if split == "calibration" else text[cut:]


def read_text(source: str, split: Split) -> str:
    """``source`` is "pydoc" (its ``split`` half) or a .txt / .jsonl path (used whole).

    Raises ValueError for a missing, empty or unreadable file, naming what is allowed.
    """
    if source == PYDOC:
        return split_text(pydoc_text(), split)
    if not os.path.isfile(source):
        raise ValueError(
            f"{split} text {source!r} does not exist; give 'pydoc' (the built-in text) or the "
            f"path of a {' or '.join(FILE_SUFFIXES)} file"
        )
    if not source.endswith(FILE_SUFFIXES):
        raise ValueError(
            f"{split} text {source!r} must end in {' or '.join(FILE_SUFFIXES)} (plain text, or "
            "JSON lines with a \"text\" field); or give 'pydoc'"
        )
    text = _read_jsonl(source) if source.endswith(".jsonl") else _read_txt(source)
    if not text.strip():
        raise ValueError(f"{split} text {source!r} is empty (no text to use)")
    return text


def _read_txt(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _read_jsonl(path: str) -> str:
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not JSON: {e}") from None
            if not isinstance(item, dict) or not isinstance(item.get("text"), str):
                raise ValueError(
                    f'{path} line {number}: expected an object with a string "text" field, '
                    f"got {line.strip()[:80]!r}"
                )
            texts.append(item["text"])
    return "\n\n".join(texts)

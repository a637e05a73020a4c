"""Grammars from ``StructuredOutputsParams``, validated once and cached; matchers per sequence.

Torch-free: the engine calls this when a request arrives (a bad schema is a ``ValueError``
then, before anything is queued) and gives every sequence its own matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from llmserve.structured_output.params import StructuredOutputsParams

CACHE_SIZE = 256


def grammar_spec(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the constraint (not yet checked against a tokenizer)."""
    matcher = llguidance.LLMatcher
    kind = params.kind
    layout = {"whitespace_flexible": False} if params.disable_any_whitespace else None
    if kind == "json":
        return matcher.grammar_from_json_schema(json.dumps(params.json), defaults=layout)
    if kind == "json_object":
        return matcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=layout)
    if kind == "regex":
        return matcher.grammar_from_regex(params.regex)
    if kind == "choice":  # Lark string literals use JSON's escapes
        return matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice)
        )
    text = params.grammar
    if "::=" in text:  # GBNF (llama.cpp / xgrammar EBNF)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # the library's parse error, reworded
            raise ValueError(f"structured_outputs.grammar is not valid GBNF: {exc}") from None
    return matcher.grammar_from_lark(text)


class GrammarCompiler:
    """Validates constraints against one tokenizer and makes matchers (thread-safe)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        """llguidance's view of the vocabulary (built on first use: about half a second)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The validated grammar of ``params``; ``ValueError`` naming the problem otherwise."""
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        spec = grammar_spec(params)
        error = llguidance.LLMatcher.validate_grammar(spec, self.ll_tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {error.strip()}")
        with self._lock:
            self._cache[key] = spec
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return spec

    def matcher(self, spec: str):
        """A fresh matcher at the grammar's start."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, spec)
        if matcher.is_error():
            raise ValueError(f"structured output grammar failed to start: {matcher.get_error()}")
        return matcher

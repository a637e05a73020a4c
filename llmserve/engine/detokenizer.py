"""Turn a stream of generated token ids into a stream of text deltas."""

from collections.abc import Sequence
from typing import Any

# Prompt tokens kept as left context, so the first output token decodes as it would mid-text.
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decode one request's output tokens incrementally, in O(window) work per token.

    Only a small sliding window of token ids is decoded each step:

        token_ids:  ... p  p  p | o  o  o | o  o  (new)
                                ^prefix    ^read
                                 _offset    _offset
        prefix_text = decode(token_ids[prefix_offset:read_offset])   (already emitted)
        new_text    = decode(token_ids[prefix_offset:])
        delta       = new_text[len(prefix_text):]

    A byte-level BPE token can hold part of a UTF-8 character (Korean, emoji); the window
    decodes it as U+FFFD, so a delta ending in U+FFFD is held back (the offsets stay put)
    until later tokens complete the character. Concatenating the deltas, plus `finish()`,
    gives `tokenizer.decode(output_ids, skip_special_tokens=...)`.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._output_text = ""

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenated deltas)."""
        return self._output_text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _pending_text(self) -> str:
        """Text decoded past `read_offset` that has not been emitted yet."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""

    def _emit(self, delta: str) -> str:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._output_text += delta
        return delta

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" if none yet)."""
        self.token_ids.append(token_id)
        delta = self._pending_text()
        if not delta or delta.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(delta)

    def finish(self) -> str:
        """Return the held-back tail (e.g. an incomplete character, as U+FFFD) at the end."""
        return self._emit(self._pending_text())

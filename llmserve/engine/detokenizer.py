"""Turn a stream of generated token ids into a stream of text deltas.

``make_detokenizer`` picks one of two with the same interface (``append``, ``finish``,
``output_text``) and the same deltas (``NoDetokenizer``, no text at all, for a request with
``detokenize=False``):

- ``StreamDetokenizer`` for a fast (Rust ``tokenizers``) tokenizer: the library's own
  ``DecodeStream``, one step per token (SmolLM2's tokenizer, 4,684 tokens of pydoc text: 0.6
  us a token against 4.4 for the window below; about 0.25 ms of a 31 ms decode step at batch
  64, where every running sequence decodes its token);
- ``IncrementalDetokenizer`` for any other: two ``tokenizer.decode`` calls a token over a
  small window.
"""

from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens kept as left context, so the first output token decodes as it would mid-text.
_NUM_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 24  # StreamDetokenizer: looked back at most this far for a clean start
_REPLACEMENT_CHAR = "\ufffd"


def _text_after(decode: Callable[[list[int]], str], context: list[int], ids: list[int]) -> str:
    """The text ``ids`` add after ``context``, both decoded together so that a leading space or
    a character split across tokens comes out as in running text."""
    prefix_text = decode(context)
    new_text = decode(context + ids)
    return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def make_detokenizer(
    tokenizer: Any,
    prompt_token_ids: Sequence[int],
    skip_special_tokens: bool = True,
    detokenize: bool = True,
) -> "IncrementalDetokenizer | StreamDetokenizer | NoDetokenizer":
    """The fast detokenizer where the tokenizer's backend is a ``tokenizers.Tokenizer`` whose
    ``decode`` adds nothing to the backend's (no ``clean_up_tokenization_spaces``), else the
    window one; none where ``detokenize`` is False."""
    if not detokenize:
        return NoDetokenizer()
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        return StreamDetokenizer(backend, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)


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
        ids, prefix, read = self.token_ids, self.prefix_offset, self.read_offset
        return _text_after(self._decode, ids[prefix:read], ids[read:])

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


class StreamDetokenizer:
    """The same deltas as ``IncrementalDetokenizer`` from ``tokenizers``' ``DecodeStream``,
    which keeps its own window and holds back a token that ends inside a UTF-8 character
    (``step`` returns None) until a later one completes it.

    The stream is primed with the prompt's last tokens (at least ``_NUM_CONTEXT_TOKENS``, more
    where those start inside a character), so the first output token decodes as it would
    mid-text. ``finish`` decodes what is still held back beside the last few tokens emitted,
    as the window detokenizer does (an incomplete character comes out as U+FFFD)."""

    def __init__(
        self,
        backend: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        context = self._clean_suffix(list(prompt_token_ids))
        self.stream = self._stream_after(context)
        self._recent = context[-_NUM_CONTEXT_TOKENS:]  # the last tokens emitted (or primed)
        self._held: list[int] = []  # tokens since the last delta
        self._output_text = ""

    def _clean_suffix(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last tokens, from the first place past ``_NUM_CONTEXT_TOKENS`` back
        that does not start inside a character (``_MAX_CONTEXT_TOKENS`` at most)."""
        longest = min(len(prompt_token_ids), _MAX_CONTEXT_TOKENS)
        for n in range(min(_NUM_CONTEXT_TOKENS, longest), longest + 1):
            suffix = prompt_token_ids[len(prompt_token_ids) - n :]
            if _REPLACEMENT_CHAR not in self._decode(suffix):
                return suffix
        return prompt_token_ids[len(prompt_token_ids) - longest :]

    def _stream_after(self, context: list[int]) -> DecodeStream:
        """A DecodeStream that has decoded ``context`` (a fresh one if it refuses to)."""
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        try:
            for token_id in context:
                stream.step(self.backend, token_id)
        except Exception:  # a start that is no prefix of what follows: begin with no context
            stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return stream

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenated deltas)."""
        return self._output_text

    def _decode(self, token_ids: list[int]) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, delta: str) -> str:
        self._recent = (self._recent + self._held)[-_NUM_CONTEXT_TOKENS:]
        self._held = []
        self._output_text += delta
        return delta

    def _held_text(self) -> str:
        """The held tokens' text, decoded beside the last tokens emitted (the window way)."""
        return _text_after(self._decode, self._recent, self._held)

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" if none yet)."""
        self._held.append(token_id)
        try:
            delta = self.stream.step(self.backend, token_id)
        except Exception:  # DecodeStream refuses a prefix that now decodes otherwise
            delta = self._held_text()  # this token the window way, and a fresh stream after it
            self.stream = self._stream_after(self._recent + self._held)
            if delta.endswith(_REPLACEMENT_CHAR):
                return ""
        return self._emit(delta) if delta else ""

    def finish(self) -> str:
        """Return the held-back tail (e.g. an incomplete character, as U+FFFD) at the end."""
        return self._emit(self._held_text()) if self._held else ""


class NoDetokenizer:
    """``SamplingParams(detokenize=False)``: token ids only, the text stays empty (vLLM's;
    no decoding work per token)."""

    output_text = ""

    def append(self, token_id: int) -> str:
        return ""

    def finish(self) -> str:
        return ""

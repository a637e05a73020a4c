"""Logprobs in the two OpenAI shapes: completions (parallel lists) and chat (one entry per token).

The engine gives, per generated token, ``{token_id: logprob}`` holding the top-N tokens and
the sampled one. Here the ids become text, the top-N are sorted, and ``-inf`` is clamped so
the body stays valid JSON.
"""

from __future__ import annotations

import math
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from llmserve.entrypoints.openai.protocol import CompletionLogProbs
from llmserve.entrypoints.openai.protocol_chat import ChatLogProbs, TokenLogprob, TopLogprob

_MIN_LOGPROB = -9999.0


class TokenTexts:
    """Decoded text of single tokens, cached."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


class TokenIdTexts(TokenTexts):
    """Tokens written as ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``): every token
    named exactly, those that are no text of their own (part of a UTF-8 character) too."""

    def __init__(self) -> None:
        self.text = "token_id:{}".format


def _clamp(logprob: float) -> float:
    return _MIN_LOGPROB if math.isnan(logprob) else max(logprob, _MIN_LOGPROB)


def _top(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:num_top]


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, float] | None],
    num_top: int,
    texts: TokenTexts,
    text_offset: int = 0,
) -> CompletionLogProbs:
    """The completions shape; a ``None`` entry (the first prompt token) has no logprob."""
    result = CompletionLogProbs()
    for token_id, entry in zip(token_ids, logprobs):
        token = texts.text(token_id)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_clamp(entry.get(token_id, -math.inf)))
        result.top_logprobs.append({texts.text(t): _clamp(lp) for t, lp in _top(entry, num_top)})
    return result


def merge_completion_logprobs(first: CompletionLogProbs, second: CompletionLogProbs) -> None:
    """Append ``second`` to ``first`` (echoed prompt, then the completion)."""
    first.tokens += second.tokens
    first.text_offset += second.text_offset
    first.token_logprobs += second.token_logprobs
    first.top_logprobs += second.top_logprobs


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, float]],
    num_top: int,
    texts: TokenTexts,
) -> ChatLogProbs:
    """The chat shape: token, logprob, UTF-8 bytes and the sorted top alternatives."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        token = texts.text(token_id)
        top = [
            TopLogprob(token=texts.text(t), logprob=_clamp(lp), bytes=list(texts.text(t).encode()))
            for t, lp in _top(entry, num_top)
        ]
        content.append(
            TokenLogprob(
                token=token,
                logprob=_clamp(entry.get(token_id, -math.inf)),
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogProbs(content=content)

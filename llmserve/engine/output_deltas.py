"""A request's cumulative outputs sent between processes as what changed since the last step.

``RequestOutput`` is a snapshot of everything a request has produced: prompt token ids, every
output token, the text. Sent whole every step from the engine-core process, the prompt and
the outputs so far would be pickled again and again (quadratic in the output's length, and
paid in the engine's process, between forward steps). ``OutputEncoder`` (engine-core side)
turns each snapshot into a ``Delta``: the prompt once, then per completion the new text, the
new token ids and logprobs, and the few fields that are replaced (finish reason, cumulative
logprob, metrics). ``OutputDecoder`` (server side) rebuilds the same snapshots.

Text and token ids only grow for sampled requests (the encoder checks the text, which a stop
string may cut, and trusts the token ids); beam search, which reorders its live beams, is
sent whole. Each snapshot the decoder builds has lists of its own (the old ones are extended
into new lists, never in place), as the engine's own snapshots do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmserve.outputs import CompletionOutput, RequestOutput


@dataclass
class CompletionDelta:
    """One completion's change: ``text``/``token_ids``/``logprobs`` replace the old ones
    when their ``*_from`` is 0, else they extend the first ``*_from`` items kept."""

    index: int
    text: str
    text_from: int
    token_ids: list[int]
    tokens_from: int
    logprobs: list | None
    logprobs_from: int
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class Delta:
    """One ``RequestOutput`` as the change since the request's previous one."""

    request_id: str
    prompt: Any  # (text, token ids, prompt logprobs) the first time or when changed, else None
    outputs: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    metrics: dict[str, float]


@dataclass
class _Sent:
    """One completion as last sent (the encoder reads only the lengths and the text)."""

    text: str
    token_ids: list[int]
    logprobs: list | None


class OutputEncoder:
    """Engine-core side: RequestOutput -> Delta, remembering what each request was sent."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, _Sent]] = {}
        self._prompt_logprobs_len: dict[str, int] = {}

    def encode(self, output: RequestOutput, grows: bool = True) -> Delta:
        """``grows``: the request's outputs only ever grow (False for beam search)."""
        rid = output.request_id
        first = rid not in self._sent
        sent = self._sent.setdefault(rid, {})
        num_prompt_logprobs = len(output.prompt_logprobs or ())
        prompt = None
        if first or num_prompt_logprobs != self._prompt_logprobs_len.get(rid, 0):
            prompt = (output.prompt, output.prompt_token_ids, output.prompt_logprobs)
            self._prompt_logprobs_len[rid] = num_prompt_logprobs
        deltas = [_completion_delta(c, sent.get(c.index), grows) for c in output.outputs]
        for c in output.outputs:
            sent[c.index] = _Sent(c.text, c.token_ids, c.logprobs)
        if output.finished:
            self.forget(rid)
        return Delta(rid, prompt, deltas, output.finished, output.num_cached_tokens, output.metrics)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._prompt_logprobs_len.pop(request_id, None)


def _completion_delta(new: CompletionOutput, old: _Sent | None, grows: bool) -> CompletionDelta:
    text, text_from = new.text, 0
    tokens, tokens_from = new.token_ids, 0
    logprobs, logprobs_from = new.logprobs, 0
    if old is not None and grows:
        if len(text) >= len(old.text) and text.startswith(old.text):
            text, text_from = text[len(old.text) :], len(old.text)
        if len(tokens) >= len(old.token_ids):
            tokens, tokens_from = tokens[len(old.token_ids) :], len(old.token_ids)
        if logprobs is not None and old.logprobs is not None and len(logprobs) >= len(old.logprobs):
            logprobs, logprobs_from = logprobs[len(old.logprobs) :], len(old.logprobs)
    return CompletionDelta(
        new.index, text, text_from, tokens, tokens_from, logprobs, logprobs_from,
        new.cumulative_logprob, new.finish_reason, new.stop_reason,
    )  # fmt: skip


class OutputDecoder:
    """Server side: Delta -> the RequestOutput the engine built."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple] = {}
        self._sent: dict[str, dict[int, _Sent]] = {}

    def decode(self, delta: Delta) -> RequestOutput:
        rid = delta.request_id
        if delta.prompt is not None:
            self._prompts[rid] = delta.prompt
        prompt, prompt_token_ids, prompt_logprobs = self._prompts[rid]
        sent = self._sent.setdefault(rid, {})
        outputs = []
        for d in delta.outputs:
            old = sent.get(d.index)
            text = old.text[: d.text_from] + d.text if d.text_from else d.text
            tokens = old.token_ids[: d.tokens_from] + d.token_ids if d.tokens_from else d.token_ids
            logprobs = d.logprobs
            if d.logprobs_from and logprobs is not None:
                logprobs = old.logprobs[: d.logprobs_from] + logprobs
            sent[d.index] = _Sent(text, tokens, logprobs)
            outputs.append(
                CompletionOutput(
                    d.index,
                    text,
                    tokens,
                    d.cumulative_logprob,
                    logprobs,
                    d.finish_reason,
                    d.stop_reason,
                )  # fmt: skip
            )
        if delta.finished:
            self.forget(rid)
        return RequestOutput(
            rid, prompt, prompt_token_ids, outputs, delta.finished, prompt_logprobs,
            delta.num_cached_tokens, delta.metrics,
        )  # fmt: skip

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        self._sent.pop(request_id, None)

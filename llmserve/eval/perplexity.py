"""Sliding-window perplexity through the engine (any model and ``--quantization`` it runs).

The text's tokens are cut into windows of ``window`` tokens that start every ``stride``
tokens; each window scores only the tokens the previous one did not (all of them in the
first), each predicted from up to ``window - 1`` tokens before it:

    tokens   0 ........................................................ n
    window 1 [=============== scored ===============]
    window 2                    [.... context ....][==== scored ====]
    window 3                                       [.... context ....][== scored ==]

    perplexity = exp(-sum(log p(scored token | its window's tokens before it)) / count)

Every window is one request with ``prompt_logprobs=0`` and one output token, so the engine
batches them like any other prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    num_tokens: int
    """Tokens scored (the text's tokens minus the first, which nothing predicts)."""
    num_windows: int
    negative_log_likelihood: float
    """Sum over the scored tokens, in nats."""


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_scored)`` token positions of each window (scored: first..end-1)."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(
            f"window {window} and stride {stride} are not allowed; allowed: window >= 2 and "
            "1 <= stride <= window"
        )
    spans, scored_up_to = [], 1  # token 0 has no prediction
    for begin in range(0, max(num_tokens - 1, 1), stride):
        end = min(begin + window, num_tokens)
        if end > scored_up_to:
            spans.append((begin, end, scored_up_to))
            scored_up_to = end
        if end == num_tokens:
            break
    return spans


def perplexity(llm, token_ids: list[int], window: int, stride: int) -> PerplexityResult:
    """Perplexity of ``token_ids`` under ``llm`` (an ``LLM``) with the windows above."""
    if len(token_ids) < 2:
        raise ValueError(f"the text has {len(token_ids)} tokens; perplexity needs at least 2")
    spans = windows(len(token_ids), window, stride)
    prompts = [{"prompt_token_ids": token_ids[begin:end]} for begin, end, _ in spans]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll, count = 0.0, 0
    for (begin, end, first), output in zip(spans, outputs, strict=True):
        logprobs = output.prompt_logprobs  # [window]; entry i: log p(token i | tokens < i)
        for position in range(first, end):
            entry = logprobs[position - begin]
            nll -= entry[token_ids[position]]
            count += 1
    return PerplexityResult(math.exp(nll / count), count, len(spans), nll)

"""Lossless acceptance of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

A speculating sequence brings K drafts d1..dK and the target's K + 1 rows of logits: row j
is the target's distribution p_j for the token after ``[.., d1..dj]``. Every row goes through
the sampler's own stages (logit_bias, min_tokens, penalties over the output *and the drafts
before it*, temperature, top-k/top-p/min-p), so speculation changes nothing a request asked for.

    greedy rows:  accept while argmax(p_j) == d_{j+1}; then append argmax(p_j) at the first
                  mismatch (or argmax(p_K) when all K were accepted): exactly the tokens
                  decoding without speculation would give.
    random rows:  accept d_{j+1} with probability min(1, p_j(d) / q_j(d)); on rejection draw
                  from normalize(max(p_j - q_j, 0)) and stop; all accepted: draw a bonus
                  from p_K. The result is distributed exactly as p. An n-gram draft is a
                  certain guess, q = one-hot(d), so it is accepted with probability p_j(d)
                  and a rejection draws from p_j with d removed.

Seeded rows take every uniform and every draw from their own generator, in a fixed order,
so a seed reproduces its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.runner.logprobs import top_logprobs
from llmserve.runner.sampler import SamplingRow, argmax_and_probs, draw_tokens

Sample = tuple[int, dict[int, float] | None]  # token id, logprobs


@dataclass
class Verification:
    """One sequence's drafts and, for a drafter that sampled, the q row of each draft."""

    drafts: list[int]
    draft_probs: torch.Tensor | None  # [K, vocab] fp32; None: one-hot (ngram) or greedy
    rows: list[SamplingRow]  # K + 1 rows: row j sees the output plus drafts[:j]


def verify(
    logits: torch.Tensor, items: list[Verification], kernels: str = "torch"
) -> list[list[Sample]]:
    """``logits`` [sum(K_i + 1), vocab] raw target rows, item by item; returns each item's
    accepted drafts plus one target token (1 .. K + 1 tokens), with logprobs where asked.
    ``kernels``: the sampler's (``"cpp"``: the C++ argmax on the CPU)."""
    rows = [row for item in items for row in item.rows]
    assert logits.shape[0] == len(rows), (logits.shape, len(rows))
    argmax, random_rows, p = argmax_and_probs(logits, rows, kernels)
    probs = {r: p[k] for k, r in enumerate(random_rows)}
    tokens: list[list[int]] = []
    first = 0
    for item in items:
        if item.rows[0].params.is_greedy:
            tokens.append(_accept_greedy(item.drafts, argmax[first : first + len(item.rows)]))
        else:
            p_rows = [probs[first + j] for j in range(len(item.rows))]
            tokens.append(_accept_random(item, p_rows))
        first += len(item.rows)
    return _with_logprobs(logits, items, tokens)


def _accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return drafts[:accepted] + [argmax[accepted]]


def _accept_random(item: Verification, p_rows: list[torch.Tensor]) -> list[int]:
    generator = item.rows[0].generator
    out: list[int] = []
    for j, draft in enumerate(item.drafts):
        p = p_rows[j]
        q_draft = 1.0 if item.draft_probs is None else float(item.draft_probs[j, draft])
        u = torch.rand((), generator=generator, device=p.device).item()
        if u < float(p[draft]) / q_draft:  # min(1, p/q) without the min: u < 1 always
            out.append(draft)
            continue
        if item.draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - item.draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: rejection had probability 0
            residual = p
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(p_rows[-1], generator))  # all accepted: a bonus token from p_K
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(draw_tokens(probs[None], [generator])[0])


def _with_logprobs(
    logits: torch.Tensor, items: list[Verification], tokens: list[list[int]]
) -> list[list[Sample]]:
    """Raw-model logprobs of each emitted token (row j for the j-th token), where asked."""
    wanted_rows, wanted_tokens, nums = [], [], []
    first = 0
    for item, emitted in zip(items, tokens, strict=True):
        num = item.rows[0].params.logprobs
        if num is not None:
            wanted_rows += range(first, first + len(emitted))
            wanted_tokens += emitted
            nums += [num] * len(emitted)
        first += len(item.rows)
    dicts = iter(())
    if wanted_rows:
        index = torch.tensor(wanted_rows, device=logits.device)
        targets = torch.tensor(wanted_tokens, device=logits.device)
        dicts = iter(top_logprobs(logits[index], targets, nums))
    return [
        [(t, next(dicts) if item.rows[0].params.logprobs is not None else None) for t in emitted]
        for item, emitted in zip(items, tokens, strict=True)
    ]

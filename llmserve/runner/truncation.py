"""Which tokens a sampled row may draw: top-k, top-p (the nucleus) and min-p.

``sampler.py`` runs them in this order after the temperature: ``apply_top_k`` or
``apply_top_k_top_p`` on the logits, then ``apply_min_p`` on the probabilities. On the CPU
the rows without a top-k skip these and draw in the C++ ``draw_rows`` (kernels/cpu), which
finds the same nucleus from a histogram of the weights.
"""

from __future__ import annotations

import math

import torch


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Masks all but each row's ``top_k`` largest logits; top_k >= vocab_size keeps all.

    Logits tied with the k-th largest are kept as well.
    """
    vocab_size = logits.shape[-1]
    top_values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k], descending
    kth = top_values.gather(-1, top_k.clamp(max=max_top_k)[:, None] - 1)  # [num_rows, 1]
    kth = kth.masked_fill(top_k[:, None] >= vocab_size, -math.inf)  # rows with top-k off
    return logits.masked_fill(logits < kth, -math.inf)


_NUCLEUS_CANDIDATES = (256, 4096)  # how many best logits a row's nucleus is looked for among


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, num_candidates: int
) -> torch.Tensor:
    """Keeps each row's top_k logits, then the smallest set of them whose probability
    reaches top_p (the top token always stays). top_p = inf turns it off for a row.

    Only each row's best logits are sorted: its ``num_candidates`` (the largest top_k, when
    every row has one), else its best 256, then 4,096 for the rows whose nucleus was not
    among those (they held less than top_p of its probability, or keep a top_k beyond them),
    then the whole vocabulary for any left. On 2 CPU cores, [64, 49152]: a full sort
    takes about 80-100 ms, the best 256 of each row 3 ms, 4,096 17 ms; SmolLM2's nucleus at
    top_p 0.95 and temperature 1 held a median 236 tokens, at most 1,565 (96 rows of text).
    """
    vocab_size = logits.shape[-1]
    if num_candidates < vocab_size:  # every row keeps a top_k: sort the largest one
        return top_k_top_p_sorted(logits, top_k, top_p, num_candidates)
    k = top_k if top_k is not None else torch.full_like(top_p, vocab_size, dtype=torch.int64)
    untouched = (k >= vocab_size) & torch.isinf(top_p)  # neither knob on: every token stays
    kept = torch.where(untouched[:, None], logits, -math.inf)
    pending = (~untouched).nonzero().squeeze(-1)  # [num_pending] rows still to do
    for num_best in _NUCLEUS_CANDIDATES:
        if not pending.numel() or num_best >= vocab_size:
            break
        rows = logits if pending.numel() == logits.shape[0] else logits[pending]
        rows_kept, fits = _nucleus_among_best(rows, k[pending], top_p[pending], num_best)
        kept[pending[fits]] = rows_kept[fits]
        pending = pending[~fits]
    if pending.numel():
        rest_k = None if top_k is None else top_k[pending]
        kept[pending] = top_k_top_p_sorted(logits[pending], rest_k, top_p[pending], vocab_size)
    return kept


def _nucleus_among_best(
    logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, num_best: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_top_k_top_p`` from each row's best ``num_best`` logits (``k``: each row's top_k,
    the vocabulary size where off), and per row whether that was all it needed."""
    vocab_size = logits.shape[-1]
    best, best_ids = logits.topk(num_best, dim=-1)  # [num_rows, num_best], descending
    ranks = torch.arange(num_best, device=logits.device)  # [num_best]
    best = best.masked_fill(ranks >= k[:, None], -math.inf)
    whole = k >= vocab_size  # top_k off: the nucleus of the whole row's distribution
    log_norm = torch.where(whole, logits.logsumexp(dim=-1), best.logsumexp(dim=-1))
    probs = (best - log_norm[:, None]).exp()  # [num_rows, num_best]
    mass = probs.cumsum(dim=-1)  # of the best tokens so far
    fits = (k <= num_best) | (whole & (mass[:, -1] >= top_p))
    best = best.masked_fill(mass - probs >= top_p[:, None], -math.inf)
    return torch.full_like(logits, -math.inf).scatter_(-1, best_ids, best), fits


def top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, num_candidates: int
) -> torch.Tensor:
    """``apply_top_k_top_p`` over each row's best ``num_candidates`` logits, sorted: every
    row's top_k (when it has one) and nucleus must lie among them."""
    if num_candidates < logits.shape[-1]:
        sorted_logits, sorted_ids = logits.topk(num_candidates, dim=-1)  # [num_rows, cand]
    else:
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [num_rows, vocab]
    sorted_logits = keep_top_k_top_p(sorted_logits, top_k, top_p)
    return torch.full_like(logits, -math.inf).scatter_(-1, sorted_ids, sorted_logits)


def keep_top_k_top_p(
    sorted_logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Logits sorted best first, each row's past its top_k and past its nucleus (the mass of
    the better ones already reaches top_p) set to -inf; None: that knob is off everywhere."""
    if top_k is not None:
        ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)  # [cand]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], -math.inf)
    if top_p is None:
        return sorted_logits
    probs = sorted_logits.softmax(dim=-1)  # [num_rows, cand]
    mass_before = probs.cumsum(dim=-1) - probs  # [num_rows, cand], of the better tokens
    return sorted_logits.masked_fill(mass_before >= top_p[:, None], -math.inf)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes probabilities below ``min_p`` x the row's largest (left unnormalized)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [num_rows, 1]
    return probs.masked_fill(probs < threshold, 0.0)

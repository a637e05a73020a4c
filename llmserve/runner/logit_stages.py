"""The logit stages that mask or shift single tokens before the penalties
(``sampler.penalized_logits`` runs them in this order): ``allowed_token_ids``, ``bad_words``,
``logit_bias``, the ``min_tokens`` mask. Each is out of place and a no-op (the same tensor)
when no row of the batch asks for it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from llmserve.runner.inputs import device_tensor

if TYPE_CHECKING:
    from llmserve.runner.sampler import SamplingRow


def _tail(tokens: Sequence[int], k: int) -> list[int]:
    """The last ``k`` output tokens: ``OutputTokens.tail`` reads them in place."""
    tail = getattr(tokens, "tail", None)
    return tail(k) if tail is not None else list(tokens)[-k:]


def apply_allowed_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """-inf for every token outside a row's ``allowed_token_ids`` (rows without keep theirs)."""
    limited = [(i, row.params.allowed_token_ids) for i, row in enumerate(rows)]
    limited = [(i, ids) for i, ids in limited if ids is not None]
    if not limited:
        return logits
    mask = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool)
    for i, ids in limited:
        mask[i] = True
        mask[i, ids] = False
    return logits.masked_fill(mask.to(logits.device, non_blocking=True), -math.inf)


def apply_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """-inf for the token that would complete one of a row's ``bad_words_token_ids``: a
    one-token word always, a longer one where the output ends with all but its last token."""
    banned_rows, banned_ids = [], []
    for i, row in enumerate(rows):
        for word in row.params.bad_words_token_ids or ():
            before = word[:-1]
            if before and _tail(row.output_token_ids, len(before)) != before:
                continue
            if 0 <= word[-1] < logits.shape[-1]:
                banned_rows.append(i)
                banned_ids.append(word[-1])
    if not banned_rows:
        return logits
    index = device_tensor([banned_rows, banned_ids], torch.int64, logits.device)
    return logits.index_put((index[0], index[1]), torch.tensor(-math.inf, device=logits.device))


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Adds each row's ``logit_bias``; token ids outside the vocabulary are ignored."""
    vocab_size = logits.shape[-1]
    row_ids, token_ids, biases = [], [], []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            if 0 <= token_id < vocab_size:
                row_ids.append(i)
                token_ids.append(token_id)
                biases.append(bias)
    if not row_ids:
        return logits
    index = device_tensor([row_ids, token_ids], torch.int64, logits.device)  # [2, num_biases]
    values = device_tensor(biases, logits.dtype, logits.device)  # [num_biases]
    return logits.index_put((index[0], index[1]), values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Masks EOS and ``stop_token_ids`` to -inf in rows with fewer than ``min_tokens`` outputs.

    EOS is masked even with ``ignore_eos``: min_tokens promises that many real tokens.
    """
    vocab_size = logits.shape[-1]
    row_ids, token_ids = [], []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        banned = set(row.params.stop_token_ids or [])
        if row.eos_token_id is not None:
            banned.add(row.eos_token_id)
        banned = [t for t in banned if 0 <= t < vocab_size]
        row_ids += [i] * len(banned)
        token_ids += banned
    if not row_ids:
        return logits
    index = device_tensor([row_ids, token_ids], torch.int64, logits.device)  # [2, num_banned]
    minus_inf = torch.tensor(-math.inf, dtype=logits.dtype, device=logits.device)
    return logits.index_put((index[0], index[1]), minus_inf)

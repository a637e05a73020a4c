"""The runner's half: disallowed tokens' logits set to -inf, all constrained rows at once."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch


@cache
def _executor():
    """llguidance's thread pool: the rows' masks are computed in parallel, outside the GIL."""
    from llguidance import LLExecutor

    return LLExecutor()


def apply_grammar_masks(logits: torch.Tensor, matchers: list[Any | None]) -> torch.Tensor:
    """``logits [rows, vocab]``; ``matchers[i]`` constrains row ``i`` (None: unconstrained).

    One int32 bitmask for the batch (bit ``t`` of a row set: token ``t`` allowed; rows without
    a matcher all ones), the constrained rows filled in parallel by llguidance, then applied in
    one pass by llguidance's kernel, on fp32 logits (a copy of others; fp32 ones in place).
    Without a matcher ``logits`` come back as they are."""
    rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    logits = logits.float()
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par
    from llguidance.torch import apply_token_bitmask_inplace

    bitmask = allocate_token_bitmask(len(matchers), logits.shape[-1])  # all allowed
    fill_next_token_bitmask_par(_executor(), rows, bitmask)
    apply_token_bitmask_inplace(logits, torch.from_numpy(bitmask).to(logits.device))
    return logits

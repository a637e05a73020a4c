"""The runner's half: disallowed tokens' logits set to -inf, all constrained rows at once."""

from __future__ import annotations

from typing import Any

import torch


def apply_grammar_masks(logits: torch.Tensor, matchers: list[Any | None]) -> torch.Tensor:
    """``logits [rows, vocab]``; ``matchers[i]`` constrains row ``i`` (None: unconstrained).

    One int32 bitmask for the rows that have a matcher, filled by llguidance (bit ``t`` of a
    row set: token ``t`` allowed), then one masked fill on those rows."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    vocab = logits.shape[-1]
    bitmask = allocate_token_bitmask(len(rows), vocab)  # [len(rows), ceil(vocab / 32)] int32
    for j, i in enumerate(rows):
        fill_next_token_bitmask(matchers[i], bitmask, j)
    bits = torch.from_numpy(bitmask).view(torch.uint8)  # little-endian: token t = bit t % 8
    allowed = torch.stack([(bits >> k) & 1 for k in range(8)], dim=-1).reshape(len(rows), -1)
    allowed = allowed[:, :vocab].bool().to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits

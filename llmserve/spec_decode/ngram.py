"""Prompt-lookup drafting (n-gram): no model, just the sequence's own tokens.

The draft is what followed the latest earlier occurrence of the sequence's last n tokens
(prompt and output so far), trying the longest n first:

    tokens:  SELECT name FROM users WHERE users . id = ... users .
                                          ^^^^^ ^      last n = 2 tokens: "users ."
    draft:   the K tokens after the earlier "users ." -> "id = ..."

Text-to-SQL and code edits copy names from the prompt, so the guess is often right.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens (possibly none) continuing ``token_ids``."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        # Start positions i < num_tokens - n whose n tokens equal the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: num_tokens - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence's continuation
            return token_ids[start : start + k]
    return []

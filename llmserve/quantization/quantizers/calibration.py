"""Calibration sequences: consecutive, non-overlapping runs of ``seq_len`` tokens from the
start of the calibration text (pydoc's first half, or a whole file), no token used twice."""

from __future__ import annotations

import torch

from llmserve.eval.text_source import PYDOC, read_text
from llmserve.quantization.quantizers.config import DEFAULT_NUM_SAMPLES


def calibration_tokens(
    tokenizer, source: str, num_samples: int | None, seq_len: int
) -> torch.Tensor:
    """int64 ``[num_samples, seq_len]``; raises ValueError, saying how many tokens the text has,
    when it holds fewer than ``num_samples * seq_len``.

    ``num_samples`` None: 128, or for the built-in pydoc text as many as its half holds.
    """
    text = read_text(source, "calibration")
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    available = len(token_ids) // seq_len
    wanted = num_samples or DEFAULT_NUM_SAMPLES
    if num_samples is None and source == PYDOC:
        wanted = max(1, min(wanted, available))
    if len(token_ids) < wanted * seq_len:
        name = "the pydoc calibration half" if source == PYDOC else repr(source)
        raise ValueError(
            f"calibration text {name} has {len(token_ids)} tokens, fewer than --num-samples "
            f"{wanted} x --seq-len {seq_len} = {wanted * seq_len}; lower --num-samples or "
            f"--seq-len (it holds {available} samples of {seq_len}), or give a longer file"
        )
    return torch.tensor(token_ids[: wanted * seq_len], dtype=torch.int64).view(wanted, seq_len)

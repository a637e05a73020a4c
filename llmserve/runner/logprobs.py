"""Logprobs of sampled and prompt tokens: the top-N of each row's log-softmax plus the token
itself, as the OpenAI API returns them."""

from __future__ import annotations

import torch

from llmserve.outputs import Logprob

_PROMPT_LOGPROBS_CHUNK = 1024  # rows of prompt logits turned into logprobs at a time


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: list[int], num_logprobs: int
) -> list[dict[int, Logprob]]:
    """Logprobs of each prompt token given the ones before it.

    ``logits`` [n, vocab_size] are at prompt positions 0..n-1 and ``target_ids[i]`` is the
    prompt token at position i + 1. Each dict holds the top ``num_logprobs`` tokens and
    the target token. Rows are processed in chunks to bound the fp32 copy of long prompts.
    """
    assert logits.shape[0] == len(target_ids), (logits.shape, len(target_ids))
    targets = torch.tensor(target_ids, dtype=torch.int64).to(logits.device)  # [n]
    result: list[dict[int, Logprob]] = []
    for start in range(0, len(target_ids), _PROMPT_LOGPROBS_CHUNK):
        end = min(start + _PROMPT_LOGPROBS_CHUNK, len(target_ids))
        nums = [num_logprobs] * (end - start)
        result += top_logprobs(logits[start:end], targets[start:end], nums)
    return result


def top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int]
) -> list[dict[int, Logprob]]:
    """Per row: {top num_logprobs[i] tokens, then token_ids[i]: Logprob} of
    log_softmax(logits), each with its rank (the top ones 1, 2, ...; the token's, one more than
    the tokens more likely than it: vLLM's rule). Their texts are the engine's to add."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab]
    token_logprobs = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)  # [num_rows]
    token_ranks = (logprobs > token_logprobs[:, None]).sum(dim=-1) + 1  # [num_rows]
    max_top = min(max(num_logprobs), logprobs.shape[-1])
    best_logprobs, best_ids = logprobs.topk(max_top, dim=-1)  # [num_rows, max_top]
    rows = zip(
        num_logprobs,
        best_ids.tolist(),
        best_logprobs.tolist(),
        token_ids.tolist(),
        token_logprobs.tolist(),
        token_ranks.tolist(),
        strict=True,
    )
    result = []
    for n, row_top_ids, row_top_logprobs, token_id, token_logprob, token_rank in rows:
        entry = {
            t: Logprob(lp, rank)
            for rank, (t, lp) in enumerate(zip(row_top_ids[:n], row_top_logprobs[:n]), 1)
        }
        entry.setdefault(token_id, Logprob(token_logprob, token_rank))
        result.append(entry)
    return result

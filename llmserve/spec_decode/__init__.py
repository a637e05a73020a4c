"""Speculative decoding: propose K tokens cheaply, verify them all in one target pass.

A decode step streams every weight once whether it computes one token or five, so on a
memory-bound machine checking K guessed tokens costs about as much as making one. Per step,
for each speculating sequence:

    proposer      ngram.py: the continuation of the latest earlier occurrence of the last n
                  tokens (no model); draft_model.py: a small model, or the target itself
                  quantized, with its own paged KV pool on the same block tables
    verification  the target computes [last token, d1 .. dK] as one chunk (K + 1 logits)
                  beside the step's other prefills and decodes
    acceptance    rejection_sampler.py: greedy keeps the longest prefix equal to the target's
                  argmax, then the target's own token; sampled rows accept d with
                  min(1, p(d) / q(d)) and resample a rejection from max(p - q, 0)
    rollback      the scheduler counts only accepted tokens as computed and gives back the
                  blocks past them (engine/block_manager.py ``trim``): rejected slots are
                  overwritten later and never reach the prefix cache

config.py parses ``speculative_config`` (vLLM's spelling) and is torch-free, as are ngram.py
and scheduling.py (the scheduler's side: when to draft, n-gram drafts, the rollback).
"""

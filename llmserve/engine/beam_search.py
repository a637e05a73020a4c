"""Beam search inside the engine: the beams of a request are its ``n`` sequences.

Each step the runner returns, per live beam, its ``2 * width`` best next tokens with their
log-probabilities (log-softmax of the raw logits; EOS masked with ``ignore_eos``). Then, for the
request as a whole (``select``):

    candidates = beam.cumulative_logprob + logprob, over every live beam and its tokens
    best first: an EOS candidate ranked within the first ``width`` becomes a finished
        hypothesis; the others extend beams until ``width`` beams exist

and the scheduler applies the choice (``Scheduler._beam_step``, with ``assign``): the first
beam continuing from a parent *is* the parent; every further one is a fork of it, sharing all its KV blocks
through reference counts (the last, partial block copied on write when both append); a
beam that no candidate continues is pruned and its blocks are released at once.

Stopping, as transformers' default (``early_stopping=False``): at ``max_tokens``; or, once
``width`` hypotheses have finished, when the best live beam, scored at its current length,
cannot beat the worst of them. Scores are ``cumulative_logprob / length ** length_penalty``
with length = generated tokens (EOS included); the request returns its ``width`` best
hypotheses and beams by that score. If one beam is preempted (recomputed later) while its
siblings go on, it rejoins at a later step: the search stays valid but is no longer exactly
synchronous (transformers never preempts).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (EOS included) and summed log-probability."""

    token_ids: list[int]
    cumulative_logprob: float
    text: str = ""  # set when the request finishes
    finish_reason: str = "stop"  # "stop" (EOS) or "length"

    def score(self, length_penalty: float) -> float:
        return beam_score(self.cumulative_logprob, len(self.token_ids), length_penalty)


@dataclass
class BeamState:
    """Per request: finished hypotheses, and the final ranking once the request is done."""

    hypotheses: list[Hypothesis] = field(default_factory=list)  # ended with EOS
    ended: list[Hypothesis] = field(default_factory=list)  # beams alive at max_tokens
    results: list[Hypothesis] | None = None


def beam_score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    return cumulative_logprob / (max(length, 1) ** length_penalty)


@dataclass
class Continuation:
    parent: object  # the Sequence this beam extends
    token_id: int
    logprob: float
    cumulative_logprob: float


def select(
    beams: list[tuple[object, float, list[int], list[tuple[int, float]]]],
    width: int,
    eos_token_id: int | None,
    ignore_eos: bool,
) -> tuple[list[Continuation], list[Hypothesis]]:
    """``beams``: (sequence, cumulative logprob, output token ids, candidates) per live beam.

    Returns the beams of the next step (best first, at most ``width``) and the hypotheses
    that finished with EOS in this step."""
    ranked = sorted(
        (
            (cum + logprob, seq, token, logprob, output)
            for seq, cum, output, candidates in beams
            for token, logprob in candidates
        ),
        key=lambda c: c[0],
        reverse=True,
    )
    continuations: list[Continuation] = []
    finished: list[Hypothesis] = []
    for rank, (total, seq, token, logprob, output) in enumerate(ranked):
        if token == eos_token_id and not ignore_eos:
            if rank < width:
                finished.append(Hypothesis(list(output) + [token], total))
            continue
        continuations.append(Continuation(seq, token, logprob, total))
        if len(continuations) == width:
            break
    return continuations, finished


def assign(continuations: list[Continuation], seqs: list, waiting: list) -> tuple[list, list]:
    """The sequence each continuation goes to, as ``(target, continuation)`` pairs: the first
    from a parent is the parent; the others take a spare sequence (one no continuation comes
    from, not waiting to be recomputed), which becomes a fork of the parent. Also returns the
    spares left over: the pruned beams."""
    parents = {id(c.parent) for c in continuations}
    spare = [s for s in seqs if s not in waiting and id(s) not in parents]
    plan, taken = [], set()
    for c in continuations:
        target = c.parent if id(c.parent) not in taken else spare.pop()
        taken.add(id(c.parent))
        plan.append((target, c))
    return plan, spare


def is_done(
    state: BeamState, best_live: float | None, length: int, width: int, penalty: float
) -> bool:
    """No live beam can enter the best ``width`` hypotheses any more."""
    if len(state.hypotheses) < width:
        return best_live is None
    if best_live is None:
        return True
    worst = sorted(h.score(penalty) for h in state.hypotheses)[-width]
    return worst >= beam_score(best_live, length, penalty)


def final_ranking(state: BeamState, width: int, penalty: float) -> list[Hypothesis]:
    """The best ``width`` of the hypotheses and the beams alive at the end."""
    pool = state.hypotheses + state.ended
    return sorted(pool, key=lambda h: h.score(penalty), reverse=True)[:width]

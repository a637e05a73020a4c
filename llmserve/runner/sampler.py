"""Turn one step's logits into next tokens: biases, penalties, truncation, then a draw.

Per row, in this order (a stage is skipped outright when no row in the batch needs it):

    raw logits ─────────────────────────────────> logprobs (log_softmax of the raw logits)
        │
    allowed_token_ids -> bad_words -> logit_bias -> min_tokens mask -> the penalties
        │
        ├── greedy rows (temperature 0): argmax
        └── random rows: / temperature -> top_k -> top_p -> min_p -> softmax -> draw

The draw inverts the row's cumulative distribution at one uniform ``u``: the first token
whose cumulative probability passes ``u`` x the total, which is token i with probability
``probs[i]``. A row with a seed draws its ``u`` from its own generator (on the logits'
device), so its tokens do not depend on which other rows share the batch or where the row
sits in it. Top-k, top-p and min-p are in ``truncation.py``, the logprobs in ``logprobs.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.outputs import Logprob
from llmserve.runner.inputs import device_tensor
from llmserve.runner.logit_stages import (
    apply_allowed_tokens,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
)
from llmserve.runner.logprobs import top_logprobs
from llmserve.runner.penalties import apply_penalties
from llmserve.runner.truncation import (
    apply_min_p,
    apply_top_k,
    apply_top_k_top_p,
    keep_top_k_top_p,
)
from llmserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of logits to sample from, with what its sequence has seen so far."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]  # tokens this sequence generated so far (OutputTokens)
    generator: torch.Generator | None  # per-sequence generator when params.seed is set
    eos_token_id: int | None


class OutputTokens(Sequence[int]):
    """A sequence's output tokens (and the drafts being verified after them) read in place from
    its token list: the row of a running sequence used to slice its whole output out every
    step, O(output length) a row a step, where only rows with a penalty read them."""

    __slots__ = ("_ids", "_start", "_after")

    def __init__(self, token_ids: list[int], start: int, after: Sequence[int] = ()) -> None:
        self._ids, self._start, self._after = token_ids, start, tuple(after)

    def __len__(self) -> int:
        return len(self._ids) - self._start + len(self._after)

    def __iter__(self) -> Iterator[int]:
        return chain(self._ids[self._start :], self._after)

    def __getitem__(self, index):
        return list(self)[index]

    def tail(self, k: int) -> list[int]:
        """The last ``k`` tokens (fewer where there are fewer), without copying the rest."""
        after = list(self._after[-k:]) if k > 0 else []
        more = k - len(after)
        if more <= 0:
            return after
        return self._ids[max(self._start, len(self._ids) - more) :] + after


@dataclass
class SamplerOutput:
    """One sampled token per row, plus its logprobs where the row asked for them."""

    sampled_token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # top-N + sampled token; None if not requested


def sampler_kernels(attention_backend: str) -> str:
    """The sampling kernels that go with a model's attention backend: the C++ ones with the
    C++ attention (the CPU path), torch's otherwise."""
    return "cpp" if attention_backend == "cpp" else "torch"


class Sampler:
    """Samples one token per row of logits; the stages are in the module docstring.
    ``kernels="cpp"``: on the CPU, greedy rows take the C++ argmax (``greedy``) and random
    rows the C++ draw where they can (``_random_sample``)."""

    def __init__(self, kernels: str = "torch") -> None:
        self.kernels = kernels

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        raw_logits = logits  # [num_rows, vocab_size]
        logits = penalized_logits(logits, rows)
        sampled = _sample(logits, rows, self.kernels)  # [num_rows]
        logprobs = _sampled_logprobs(raw_logits, rows, sampled)
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)


def _adjusts_logits(row: SamplingRow) -> bool:
    """Whether allowed_token_ids, logit_bias, the min_tokens mask or a penalty may change this
    row's logits."""
    params = row.params
    return (
        params.allowed_token_ids is not None
        or bool(params.bad_words_token_ids)
        or bool(params.logit_bias)
        or len(row.output_token_ids) < params.min_tokens
        or params.needs_output_penalties
    )


def penalized_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logits`` after logit_bias, the min_tokens mask and the penalties: an fp32 copy, or
    the logits themselves (any dtype, no copy) when none of these acts on any row (greedy
    takes the same argmax from them: widening keeps the order)."""
    if not any(_adjusts_logits(row) for row in rows):
        return logits
    logits = logits.float()  # may alias the caller's tensor: every stage is out of place
    logits = apply_allowed_tokens(logits, rows)
    logits = apply_bad_words(logits, rows)
    logits = apply_logit_bias(logits, rows)
    logits = apply_min_tokens(logits, rows)
    return _apply_row_penalties(logits, rows)


@dataclass
class SamplingTensors:
    """Per-row knobs of the random rows, built once per step; a knob no row uses is None."""

    temperature: torch.Tensor  # [num_rows] fp32, all > 0
    top_k: torch.Tensor | None  # [num_rows] int64; vocab_size where the row has it off
    max_top_k: int  # the largest top_k among rows that use it
    num_candidates: int  # max_top_k when every row uses top_k, else vocab_size
    top_p: torch.Tensor | None  # [num_rows] fp32; inf where the row has it off
    min_p: torch.Tensor | None  # [num_rows] fp32; 0 where the row has it off

    @classmethod
    def from_params(
        cls, params: list[SamplingParams], vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_ps = [p.top_p if p.top_p < 1.0 else math.inf for p in params]
        min_ps = [p.min_p for p in params]
        used_ks = [k for k in top_ks if k < vocab_size]
        return cls(
            temperature=device_tensor([p.temperature for p in params], torch.float32, device),
            top_k=device_tensor(top_ks, torch.int64, device) if used_ks else None,
            max_top_k=max(used_ks, default=vocab_size),
            num_candidates=max(top_ks),
            top_p=device_tensor(top_ps, torch.float32, device) if min(top_ps) < 1.0 else None,
            min_p=device_tensor(min_ps, torch.float32, device) if max(min_ps) > 0.0 else None,
        )


def _apply_row_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Runs ``apply_penalties`` on just the rows that set a penalty."""
    penalized = [i for i, row in enumerate(rows) if row.params.needs_output_penalties]
    if not penalized:
        return logits
    sub_rows = [rows[i] for i in penalized]
    index = None
    if len(penalized) < len(rows):
        index = device_tensor(penalized, torch.int64, logits.device)  # [num_penalized]
    result = apply_penalties(
        logits if index is None else logits[index],
        prompt_token_ids=[row.prompt_token_ids for row in sub_rows],
        output_token_ids=[row.output_token_ids for row in sub_rows],
        repetition_penalties=[row.params.repetition_penalty for row in sub_rows],
        presence_penalties=[row.params.presence_penalty for row in sub_rows],
        frequency_penalties=[row.params.frequency_penalty for row in sub_rows],
    )
    return result if index is None else logits.index_copy(0, index, result)


def greedy(logits: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """[rows] int64: the first index of each row's largest logit, as ``argmax`` (a NaN counts
    as the largest). With ``kernels="cpp"``, fp32 or bf16 logits on the CPU take the C++
    ``argmax_rows``: [64, 49152] in 0.11 ms, fp32 or bf16, against torch's 0.78 (fp32) and
    1.24 (bf16, with its fp32 copy) on 2 Zen 5 cores. Else ``max``'s indices: the same first
    index on ties (documented), and on the CPU 2.3x faster than ``argmax``."""
    if kernels == "cpp" and _on_kernels(logits):
        return cpu_kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def _on_kernels(logits: torch.Tensor) -> bool:
    """Whether the C++ CPU kernels take these logits (fp32 or bf16, on the CPU)."""
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)


def _sample(logits: torch.Tensor, rows: list[SamplingRow], kernels: str) -> torch.Tensor:
    """[num_rows] int64: argmax for greedy rows, a random draw for the others; ``logits`` in
    any dtype (the random rows' probabilities are fp32)."""
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if not random_rows:
        return greedy(logits, kernels)
    if len(random_rows) == len(rows):
        return _random_sample(logits, rows, kernels)
    index = device_tensor(random_rows, torch.int64, logits.device)  # [num_random]
    random = [rows[i] for i in random_rows]
    sampled = _random_sample(logits[index], random, kernels)  # [num_random]
    return greedy(logits, kernels).index_copy(0, index, sampled)


def _random_sample(logits: torch.Tensor, rows: list[SamplingRow], kernels: str) -> torch.Tensor:
    """[num_rows] int64 drawn after temperature, top-k, top-p and min-p. Where no row has a
    top_k, the C++ ``draw_rows`` (``kernels="cpp"``, CPU) reads the logits as they are and
    draws with no copy of them and no sort: [64, 49152] in about 0.5 ms with the temperature
    alone, where torch's path makes three fp32 copies, and a few ms with top-p, where torch's
    sorts (SmolLM2 offline, 64 x 256/128 at temperature 1: docs/bench/journal.md)."""
    vocab_size = logits.shape[-1]
    knobs = SamplingTensors.from_params([r.params for r in rows], vocab_size, logits.device)
    generators = [row.generator for row in rows]
    in_kernel = kernels == "cpp" and _on_kernels(logits)
    if knobs.top_k is None and in_kernel:
        u = uniforms(generators, logits.device)
        top_p = None if knobs.top_p is None else knobs.top_p.clamp(max=1.0)  # inf: off
        return cpu_kernels.draw_rows(logits, 1.0 / knobs.temperature, u, top_p, knobs.min_p)
    if knobs.top_k is not None and knobs.num_candidates < vocab_size:
        return _draw_among_top_k(logits, knobs, generators)
    if knobs.top_k is not None and in_kernel:  # rows with and without a top_k: each their way
        sampled = torch.empty(len(rows), dtype=torch.int64)
        has_k = (knobs.top_k < vocab_size).tolist()
        for wanted in (True, False):
            group = [i for i, k in enumerate(has_k) if k == wanted]
            index = device_tensor(group, torch.int64, logits.device)
            sampled[index] = _random_sample(logits[index], [rows[i] for i in group], kernels)
        return sampled
    return draw_tokens(_truncated_probs(logits, knobs), generators)


def _draw_among_top_k(
    logits: torch.Tensor, knobs: SamplingTensors, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Every row has a top_k: temperature, top-p, min-p and the draw among each row's best
    ``num_candidates`` logits, with no copy of the whole rows (the same tokens kept as
    ``_truncated_probs``; [64, 49152] at top_k 100: 1-2 ms against 19-21 ms there)."""
    best, best_ids = logits.topk(knobs.num_candidates, dim=-1)  # [num_rows, cand], descending
    best = keep_top_k_top_p(best.float() / knobs.temperature[:, None], knobs.top_k, knobs.top_p)
    probs = best.softmax(dim=-1)  # [num_rows, cand]
    if knobs.min_p is not None:
        probs = apply_min_p(probs, knobs.min_p)
    picked = draw_tokens(probs, generators)  # [num_rows], ranks among the candidates
    return best_ids.gather(-1, picked[:, None]).squeeze(-1)


def argmax_and_probs(
    logits: torch.Tensor, rows: list[SamplingRow], kernels: str = "torch"
) -> tuple[list[int], list[int], torch.Tensor | None]:
    """What speculative decoding reads of a batch of rows (drafting, verifying): every row's
    argmax after the logit stages (the greedy rows' token), the random rows' indices, and
    their whole distributions normalized, [num_random, vocab] fp32 (None without random
    rows). When no stage changes a row, the logits are read as they are (no fp32 copy)."""
    logits = penalized_logits(logits, rows)
    argmax = greedy(logits, kernels).tolist()
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if not random_rows:
        return argmax, random_rows, None
    index = device_tensor(random_rows, torch.int64, logits.device)
    p = sampling_probs(logits[index], [rows[i] for i in random_rows])  # fp32
    return argmax, random_rows, p / p.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalized


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[num_rows, vocab] the distribution random rows draw from: penalized ``logits`` after
    temperature, top-k, top-p and min-p (unnormalized where min-p zeroed tokens)."""
    knobs = SamplingTensors.from_params([r.params for r in rows], logits.shape[-1], logits.device)
    return _truncated_probs(logits, knobs)


def _truncated_probs(logits: torch.Tensor, knobs: SamplingTensors) -> torch.Tensor:
    """``sampling_probs`` with the rows' knobs built."""
    logits = logits / knobs.temperature[:, None]  # [num_rows, vocab] fp32
    if knobs.top_p is not None:
        logits = apply_top_k_top_p(logits, knobs.top_k, knobs.top_p, knobs.num_candidates)
    elif knobs.top_k is not None:
        logits = apply_top_k(logits, knobs.top_k, knobs.max_top_k)
    probs = logits.softmax(dim=-1)  # [num_rows, vocab]
    if knobs.min_p is not None:
        probs = apply_min_p(probs, knobs.min_p)
    return probs


def uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[len(generators)] fp32 uniforms in [0, 1): a row with a generator draws its own."""
    u = torch.empty(len(generators), device=device)
    if any(g is None for g in generators):
        u.uniform_()
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand((), generator=generator, device=device)
    return u


def draw_tokens(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """[num_rows] int64: one draw from each row of ``probs`` (need not be normalized), the
    first token whose cumulative sum passes ``u`` x the row's total for a uniform ``u``.

    Rows with a generator draw their own ``u``; the rest share one batched draw. One random
    number a row: [64, 49152] takes about 1.5 ms on 2 CPU cores, where an exponential race
    (``argmax(probs / q)``, ``q ~ Exponential(1)`` for every token) took 46 ms drawing its
    3.1 million ``q``.
    """
    u = uniforms(generators, probs.device)  # [num_rows]
    cdf = probs.float().cumsum(dim=-1)  # [num_rows, vocab], never decreasing
    total = cdf[:, -1:]  # [num_rows, 1]
    # below the total, so the first cdf past it is a token of positive probability
    target = torch.minimum(u[:, None] * total, total.nextafter(torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [num_rows]
    return tokens.clamp_(max=probs.shape[-1] - 1)  # a row of zeros (or NaN) has no such cdf


def _sampled_logprobs(
    raw_logits: torch.Tensor, rows: list[SamplingRow], sampled: torch.Tensor
) -> list[dict[int, Logprob] | None]:
    """Per row: the raw model logprobs of the top ``params.logprobs`` tokens and the sampled one."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[dict[int, Logprob] | None] = [None] * len(rows)
    if not wanted:
        return result
    index = device_tensor(wanted, torch.int64, raw_logits.device)  # [num_wanted]
    num_logprobs = [rows[i].params.logprobs for i in wanted]
    dicts = top_logprobs(raw_logits[index], sampled[index], num_logprobs)
    for i, logprobs in zip(wanted, dicts, strict=True):
        result[i] = logprobs
    return result

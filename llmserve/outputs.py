"""What a request returns: vLLM's ``RequestOutput`` and ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """A token's log-probability, as vLLM's ``Logprob``: ``.logprob``, ``.rank`` (1: the most
    likely token of its position) and ``.decoded_token`` (its text). It is also the float
    itself, so sums and comparisons, and JSON, take it as the number."""

    rank: int | None
    decoded_token: str | None

    def __new__(
        cls, logprob: float, rank: int | None = None, decoded_token: str | None = None
    ) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple:  # pickled with its rank and text (the engine-core process)
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        return (
            f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
            f"decoded_token={self.decoded_token!r})"
        )


# One dict per position: token id -> Logprob (the sampled / actual token always included).
SampleLogprobs = list[dict[int, Logprob]]
# As above, with None for the first prompt token (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (there are ``n`` of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything a request has produced so far (or in total, once ``finished``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class BeamSearchSequence:
    """One result of ``LLM.beam_search``: prompt + generated tokens, text of the generated part."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob / generated_length ** length_penalty, the ranking key
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]

"""What a request asks for: sampling knobs, stopping rules and logprob options.

Field names and defaults follow vLLM's ``SamplingParams`` so user code ports unchanged.
Every invalid value raises ``ValueError`` naming the field and the allowed range.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from llmserve.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """Which outputs ``LLMEngine.step`` returns for a request (vLLM's names and values)."""

    CUMULATIVE = 0  # after every step that changed it, everything produced so far
    DELTA = 1  # after every step that changed it, only what that step added
    FINAL_ONLY = 2  # once, when it finishes (what ``LLM.generate`` asks for)


@dataclass
class SamplingParams:
    """Sampling parameters of one request.

    Attributes:
        n: number of output sequences for the prompt (parallel sampling).
        temperature: 0 means greedy; higher is more random.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below min_p x the top token's.
        seed: per-request seed; the same seed gives the same output whatever else is batched.
        presence_penalty: subtracted once from each token already generated (OpenAI).
        frequency_penalty: subtracted per occurrence of each generated token (OpenAI).
        repetition_penalty: divides positive / multiplies negative logits of tokens seen in
            prompt or output (CTRL / Hugging Face); 1.0 disables.
        logit_bias: token id -> bias added to its logit.
        allowed_token_ids: only these tokens may be generated (every other logit masked).
        bad_words: words never generated: the token that would complete one is masked (each
            word tokenized as given and with a leading space, as vLLM's).
        bad_words_token_ids: ``bad_words`` as token ids, filled in by the engine.
        max_tokens: maximum number of generated tokens; None means up to max_model_len.
        min_tokens: EOS and stop_token_ids are masked until this many tokens exist.
        stop: strings that end generation; they are not part of the returned text.
        stop_token_ids: token ids that end generation (kept out of the text).
        ignore_eos: keep generating after EOS.
        include_stop_str_in_output: keep the matched stop string in the text.
        logprobs: number of top logprobs returned per generated token (the sampled one too).
        prompt_logprobs: number of top logprobs returned per prompt token.
        skip_special_tokens: leave special tokens out of the detokenized text.
        detokenize: False: token ids only, no text (as vLLM's; no stop strings then).
        truncate_prompt_tokens: keep only the prompt's last k tokens (-1: the last
            max_model_len), as vLLM's; None keeps it whole.
        structured_outputs: constrain the output to a JSON schema, regex, choice list or
            grammar (``StructuredOutputsParams``, or a dict with its fields).
        use_beam_search: beam search with ``n`` beams instead of sampling (greedy scores;
            ``LLM.beam_search`` is the usual way in).
        length_penalty: beam search: a finished beam scores ``cumulative_logprob /
            generated_length ** length_penalty``.
        output_kind: which outputs the engine's step returns (``RequestOutputKind``);
            ``LLM.generate`` sets FINAL_ONLY, since it returns finished requests only.
        stream_interval: new tokens gathered into each streamed output (the first and the
            last go at once), as vLLM's; raises the engine's ``stream_interval``, never
            lowers it. None: the engine's.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0 (0 is greedy)")
        if self.use_beam_search:
            unsupported = [
                name
                for name, on in (
                    ("temperature > 0", self.temperature > 0),
                    ("stop strings", bool(self.stop)),
                    ("structured_outputs", self.structured_outputs is not None),
                    ("logprobs", self.logprobs is not None),
                    ("min_tokens", self.min_tokens > 0),
                    ("logit_bias", bool(self.logit_bias)),
                    ("allowed_token_ids", self.allowed_token_ids is not None),
                    ("bad_words", bool(self.bad_words)),
                )
                if on
            ]
            if unsupported:
                raise ValueError(
                    f"beam search scores greedy log-probabilities; it cannot be combined with "
                    f"{', '.join(unsupported)}"
                )
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are matched in the text: set detokenize=True to use stop"
            )
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "0 or -1 (disabled), or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            self.presence_penalty,
            "in [-2, 2]",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "in [-2, 2]",
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            self.repetition_penalty,
            "> 0 (1 disables)",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"<= max_tokens ({self.max_tokens})",
            )
        _check(
            self.logprobs is None or self.logprobs >= 0,
            "logprobs",
            self.logprobs,
            "an integer >= 0",
        )
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            "prompt_logprobs",
            self.prompt_logprobs,
            "an integer >= 0",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings"
        )
        if self.allowed_token_ids is not None:
            _check(
                bool(self.allowed_token_ids)
                and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                self.allowed_token_ids,
                "a non-empty list of token ids (integers >= 0)",
            )
        _check(
            all(isinstance(w, str) and w.strip() for w in self.bad_words or []),
            "bad_words",
            self.bad_words,
            "a list of words (non-blank strings)",
        )
        _check(
            self.truncate_prompt_tokens is None
            or self.truncate_prompt_tokens == -1
            or self.truncate_prompt_tokens >= 1,
            "truncate_prompt_tokens",
            self.truncate_prompt_tokens,
            "an integer >= 1, or -1 (the last max_model_len tokens)",
        )
        for bias in (self.logit_bias or {}).values():
            _check(-100.0 <= bias <= 100.0, "logit_bias", bias, "values in [-100, 100]")
        _check(
            isinstance(self.output_kind, RequestOutputKind),
            "output_kind",
            self.output_kind,
            "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)",
        )
        _check(
            self.stream_interval is None or self.stream_interval >= 1,
            "stream_interval",
            self.stream_interval,
            "an integer >= 1 (new tokens in each streamed output), or None (the engine's)",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def needs_output_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class BeamSearchParams:
    """``LLM.beam_search`` parameters (vLLM's names).

    Attributes:
        beam_width: beams kept per step, and results returned.
        max_tokens: tokens generated per beam at most.
        ignore_eos: never end a beam at EOS (every result has ``max_tokens`` tokens).
        temperature: must be 0 (beams are ranked by greedy log-probabilities).
        length_penalty: a result scores ``cumulative_logprob / length ** length_penalty``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check(self.beam_width >= 1, "beam_width", self.beam_width, "an integer >= 1")
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _check(
            self.temperature == 0.0, "temperature", self.temperature, "0 (beam search is greedy)"
        )

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width,
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            use_beam_search=True,
            length_penalty=self.length_penalty,
        )

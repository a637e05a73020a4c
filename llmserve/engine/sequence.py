"""Requests and their sequences: the engine's bookkeeping, plain Python.

A ``Request`` is what a user sent (one prompt, one SamplingParams). It owns ``n`` sequences.
With ``n > 1`` only sequence 0 is scheduled at first; when its prompt is done, the sampler
draws ``n`` first tokens from the same logits and the scheduler *forks* it: the other
sequences get copies of its block table (shared blocks, reference counts raised), so the
prompt is computed and stored once.

Every sequence follows one rule: tokens ``token_ids[num_computed_tokens:]`` still need a
forward pass; when a step computes up to ``len(token_ids)``, a new token is sampled.

    token_ids:  p0 p1 p2 p3 p4 | o0 o1 o2
                <- computed (KV in the pool) ->|<- to compute ->
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.engine.beam_search import BeamState
from llmserve.lora.request import LoRARequest
from llmserve.outputs import Logprob
from llmserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to the swap space; waits to come back
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class RequestMetrics:
    """Timestamps of one request (seconds, ``time.monotonic``)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class Sequence:
    """One output sequence of a request, with its KV block table."""

    seq_id: int
    request: Request
    index: int  # position among the request's n outputs
    token_ids: list[int]
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of full, cached blocks
    swap_ids: list[int] = field(default_factory=list)  # swap-space slots while SWAPPED
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    detokenizer: Any = None  # make_detokenizer's, set by the engine
    grammar: Any = None  # structured output: the matcher of this sequence's tokens so far
    draft_num_computed_tokens: int = 0  # speculative draft model: its KV is valid up to here
    output_text: str = ""
    num_sent_chars: int = 0  # a DELTA request's text and tokens already in its outputs
    num_sent_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1


@dataclass(eq=False)
class Request:
    """A user's request: one prompt, its sampling parameters and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None  # the prefix cache shares blocks only within one salt
    lora_request: LoRARequest | None = None  # its LoRA adapter (llmserve/lora/), or None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    seqs: list[Sequence] = field(default_factory=list)
    is_forked: bool = False  # True once all n sequences exist and run
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    beam: BeamState | None = None  # beam search requests only
    num_streamed_tokens: int = 0  # output tokens when its last output went out (stream_interval)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def lora_int_id(self) -> int:
        """Its LoRA adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_pending_forks(self) -> int:
        """Sequences that will start running when sequence 0 finishes its prompt."""
        return 0 if self.is_forked else len(self.seqs) - 1

    @property
    def max_tokens(self) -> int:
        assert self.params.max_tokens is not None  # the engine fills it in at admission
        return self.params.max_tokens

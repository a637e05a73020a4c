"""The engine loop: admit requests, run one scheduled step at a time, emit outputs.

One step:  scheduler.schedule() -> runner.execute() -> scheduler.update()
           -> output_processor (detokenize, stop rules) -> RequestOutput per updated request.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from llmserve.config import EngineConfig
from llmserve.engine.beam_search import BeamState, Hypothesis, final_ranking
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.detokenizer import make_detokenizer
from llmserve.engine.output_processor import make_request_output, output_due, process_sample
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.scheduler_output import SchedulerOutput
from llmserve.engine.sequence import FinishReason, Request, Sequence
from llmserve.lora.request import LoRARequest
from llmserve.outputs import Logprob, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.structured_output.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
MAX_CACHE_SALT_CHARS = 128  # vLLM's limit, and its forbidden characters below
SPEC_LOG_S = 10.0  # how often the speculative acceptance rate is logged


@dataclass
class EngineStats:
    """Running totals, read by the metrics endpoint and the benchmarks."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_batched_seqs: int = 0  # sum over steps of sequences per step
    max_batched_seqs: int = 0


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word's tokens as written, and with a leading space where that starts with
    another token but is as long (vLLM's rule: " word" mid-text, "word" at the start)."""
    result: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        result += [plain] if plain else []
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            result.append(spaced)
    return result


class LLMEngine:
    """Synchronous engine: ``add_request`` any time, call ``step`` until nothing is left."""

    def __init__(self, config: EngineConfig):
        from llmserve.loader import load_config, resolve_model, sampling_defaults
        from llmserve.runner.cpu_threads import check_bind_setting
        from llmserve.runner.worker import create_runner
        from llmserve.tokenizer import engine_tokenizer

        if config.parallel.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 runs engine replicas behind `llmserve serve` "
                "(llmserve/distributed/data_parallel.py); one engine takes 1"
            )
        check_bind_setting()  # a bad LLMSERVE_CPU_OMP_THREADS_BIND fails before the load
        self.config = config
        self.resolved = resolve_model(config.model.model)
        self.hf_config = load_config(self.resolved)
        model = config.model
        self.tokenizer = engine_tokenizer(
            self.resolved, model.tokenizer, self.hf_config.vocab_size, model.trust_remote_code
        )
        # what requests leave unset (the model's generation_config.json, as vLLM's "auto")
        self.sampling_defaults = sampling_defaults(self.resolved, model.generation_config)
        self.max_model_len = self._max_model_len()
        self.eos_token_id = self.tokenizer.eos_token_id
        self.grammars = GrammarCompiler(
            self.tokenizer, self.hf_config.vocab_size, self.eos_token_id
        )  # structured output: built on first use
        self.speculative = config.speculative
        drafter = None
        if self.speculative is not None and self.speculative.uses_draft_model:
            from llmserve.spec_decode.draft_model import resolve_drafter

            drafter = resolve_drafter(
                self.speculative, self.resolved, self.hf_config, self.max_model_len
            )
        if config.parallel.tensor_parallel_size > 1:  # rank 0 of N (llmserve/distributed/)
            from llmserve.distributed.executor import create_tp_runner as create_runner
        self.runner, num_blocks, info = create_runner(
            self.resolved, self.hf_config, config, self.max_model_len, self.eos_token_id, drafter
        )
        logger.info(info)
        self.kv_info = info
        self.block_manager = BlockManager(
            num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            num_swap_blocks=getattr(self.runner, "num_swap_blocks", 0),
        )
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, self.speculative, config.lora.max_loras
        )
        self._last_spec_log = time.monotonic()
        self.model_name = config.model.served_model_name or self.resolved.display_name
        self.stats = EngineStats()
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token's, by token id

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def _max_model_len(self) -> int:
        model_len = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        wanted = self.config.model.max_model_len
        return model_len if wanted is None else wanted

    # ---- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        from llmserve.tokenizer import tokenize_prompt

        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError when it can never run."""
        params = params or self.default_sampling_params()
        cache_salt = prompt_cache_salt(prompt)
        text, prompt_ids = self.tokenize(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:  # the prompt's last tokens (its text no longer matches them)
            keep = self.max_model_len if keep == -1 else keep
            if len(prompt_ids) > keep:
                text, prompt_ids = None, prompt_ids[-keep:]
        params = self._admit(prompt_ids, params)
        if params.bad_words and params.bad_words_token_ids is None:
            words = bad_words_token_ids(self.tokenizer, params.bad_words)
            params = SamplingParams(**{**vars(params), "bad_words_token_ids": words})
        grammar = None
        if params.structured_outputs is not None:  # compiled (and checked) once per constraint
            grammar = self.grammars.compile(params.structured_outputs)
        request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            self.add_lora(lora_request)
        request = Request(request_id, text, prompt_ids, params, priority, cache_salt, lora_request)
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        request.seqs = [
            Sequence(next(self._seq_counter), request, i, list(prompt_ids)) for i in range(params.n)
        ]
        if grammar is not None:
            for seq in request.seqs:
                seq.grammar = self.grammars.matcher(grammar)
        if params.use_beam_search:
            request.beam = BeamState()
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.scheduler.add(request)
        self.stats.num_prompt_tokens += len(prompt_ids)
        return request

    # ---- LoRA adapters (llmserve/lora/) -----------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (as a request naming it does); True if it was not loaded yet.
        ValueError where LoRA is off or the adapter does not fit this model."""
        if not self.config.lora.enable_lora:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is off: start "
                "the engine with enable_lora=True (--enable-lora)"
            )
        return self.runner.lora.add(lora_request, self._loras_in_use())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False if it was not loaded. ValueError while requests use it."""
        if lora_int_id in self._loras_in_use():
            raise ValueError(
                f"LoRA adapter id {lora_int_id} is in use by queued or running requests"
            )
        return self.config.lora.enable_lora and self.runner.lora.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.runner.lora.loaded) if self.config.lora.enable_lora else set()

    def _loras_in_use(self) -> set[int]:
        return {r.lora_int_id for r in self.scheduler.requests.values()} - {0}

    def _admit(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Refuse what can never fit, with the numbers and the flag to change."""
        num_prompt = len(prompt_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.hf_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in params.allowed_token_ids or [] if t >= vocab]
        if bad:
            raise ValueError(f"allowed_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        max_seqs = self.scheduler.config.max_num_seqs
        if params.n > max_seqs:
            what = "beam width" if params.use_beam_search else "n"
            raise ValueError(
                f"{what} {params.n} needs {params.n} sequences at once but the engine runs at "
                f"most {max_seqs} (--max-num-seqs)"
            )
        room = self.max_model_len - num_prompt  # generation stops at the context's end
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if max_tokens < 1:
            max_tokens = params.max_tokens or 0
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for "
                "the completion). Reduce the prompt or max_tokens, or raise --max-model-len."
            )
        bm = self.block_manager
        need = bm.num_blocks_for(num_prompt + max_tokens)
        if need > bm.num_blocks:
            raise ValueError(
                f"The request needs {need} KV cache blocks ({num_prompt} prompt + {max_tokens} output tokens, "
                f"{bm.block_size} tokens per block) but the whole pool has {bm.num_blocks} blocks. "
                "Reduce the prompt or max_tokens, or raise --kv-cache-memory (--gpu-memory-utilization on CUDA)."
            )
        if max_tokens != params.max_tokens:  # min_tokens cannot ask for more than fits
            min_tokens = min(params.min_tokens, max_tokens)
            params = SamplingParams(
                **{**vars(params), "max_tokens": max_tokens, "min_tokens": min_tokens}
            )
        return params

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests (unknown ids are ignored); returns their final "abort" outputs."""
        outputs = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None and self.scheduler.abort(request_id):
                request.metrics.finished_time = time.monotonic()
                outputs.append(make_request_output(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def compute_threads_bound(self) -> contextlib.AbstractContextManager:
        """A block in which the calling thread and torch's OpenMP workers are pinned one per
        core (CPU engines; ``LLMSERVE_CPU_OMP_THREADS_BIND``, llmserve/runner/cpu_threads.py):
        wrap the loop that calls ``step``."""
        from llmserve.runner.cpu_threads import compute_threads_bound

        return compute_threads_bound(getattr(self.runner, "device", None))

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; True when nothing stayed cached (blocks that unfinished
        requests hold keep their hashes, so False while any run)."""
        self.block_manager.reset_prefix_cache()
        return not self.block_manager.block_hash

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (``sampling_defaults``), vLLM's
        ``get_default_sampling_params``."""
        return SamplingParams(**self.sampling_defaults)

    def _name_tokens(self, logprobs: dict[int, Logprob]) -> None:
        """Each Logprob's ``decoded_token``: its token's text (cached per token id)."""
        for token_id, logprob in logprobs.items():
            text = self._token_texts.get(token_id)
            if text is None:
                text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
            logprob.decoded_token = text

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return outputs of requests that changed."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.runner.execute(sched)
        self._record_step(sched)
        for request_id, logprobs in result.prompt_logprobs.items():
            for position in logprobs:
                self._name_tokens(position)
            self.scheduler.requests[request_id].prompt_logprobs.extend(logprobs)
        changed: dict[str, Request] = {}
        now = time.monotonic()
        for sample in self.scheduler.update(sched, result.samples, self.eos_token_id):
            seq = sample.seq
            if seq.is_finished:  # stopped by an earlier token of the same verified step
                continue
            changed[seq.request.request_id] = seq.request
            self.stats.num_generation_tokens += 1
            if seq.request.beam is not None:  # text is decoded once, at the end
                self._beam_progress(seq)
                continue
            if seq.detokenizer is None:
                params = seq.request.params
                seq.detokenizer = make_detokenizer(
                    self.tokenizer,
                    seq.request.prompt_token_ids,
                    params.skip_special_tokens,
                    params.detokenize,
                )
            if sample.logprobs is not None:
                self._name_tokens(sample.logprobs)
            reason = process_sample(sample, self.eos_token_id, self.max_model_len)
            if reason is not None:
                del seq.token_ids[seq.num_prompt_tokens + sample.num_output_tokens :]
                self._finish(seq, reason)
            self._touch(seq.request, now)
        for item in sched.scheduled:  # beam requests the scheduler ended this step
            request = item.seq.request
            if request.beam is not None and request.is_finished and request.beam.results is None:
                self._beam_results(request)
                changed[request.request_id] = request
        interval = self.config.scheduler.stream_interval
        return [make_request_output(r) for r in changed.values() if output_due(r, interval)]

    def _beam_progress(self, seq: Sequence) -> None:
        """A beam that reached max_tokens (or max_model_len) ends as a candidate result."""
        if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.request.beam.ended.append(
                Hypothesis(seq.output_token_ids, seq.cumulative_logprob, finish_reason="length")
            )
            self.scheduler.finish(seq, FinishReason.LENGTH)

    def _beam_results(self, request: Request) -> None:
        params = request.params
        results = final_ranking(request.beam, params.n, params.length_penalty)
        for h in results if params.detokenize else ():
            h.text = self.tokenizer.decode(
                h.token_ids, skip_special_tokens=params.skip_special_tokens
            )
        request.beam.results = results
        request.metrics.finished_time = time.monotonic()

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.stop_reason is None or isinstance(seq.stop_reason, int):
            seq.output_text += seq.detokenizer.finish()
        self.scheduler.finish(seq, reason)
        if seq.request.is_finished:
            seq.request.metrics.finished_time = time.monotonic()

    def _touch(self, request: Request, now: float) -> None:
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now

    @property
    def spec_stats(self):
        """Speculative decoding totals (spec_decode/stats.py); all zero without it."""
        return self.scheduler.spec_stats

    def _record_step(self, sched: SchedulerOutput) -> None:
        if self.speculative is not None and time.monotonic() - self._last_spec_log > SPEC_LOG_S:
            self._last_spec_log = time.monotonic()
            if self.spec_stats.num_drafts:
                logger.info(self.spec_stats.describe())
        self.stats.num_steps += 1
        self.stats.num_batched_seqs += len(sched.scheduled)
        self.stats.max_batched_seqs = max(self.stats.max_batched_seqs, len(sched.scheduled))


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """A dict prompt's ``cache_salt`` (as vLLM's prompts carry it), checked as vLLM checks it:
    the prefix cache then shares this request's blocks only with requests of the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, not {salt!r}")
    if len(salt) > MAX_CACHE_SALT_CHARS or any(c in salt for c in "@/\\\0"):
        raise ValueError(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters and must not contain "
            "'@', '/', '\\' or NUL"
        )
    return salt

"""Drive an in-process ``LLMEngine`` through a workload, all at once or at arrival times.

    offsets:  0.0  0.0  0.3  0.9 ...   seconds after start at which request i is added
    loop:     add every request whose time has come -> engine.step() -> time each new token

Used by ``bench throughput`` (every offset 0) and by ``bench sweep`` (Poisson offsets: the
serving benchmark without HTTP, so it runs in the same process as the engine).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from llmserve.benchmarks.metrics import RequestRecord
from llmserve.benchmarks.workloads import BenchRequest
from llmserve.engine.llm_engine import LLMEngine
from llmserve.lora.request import LoRARequest
from llmserve.sampling_params import SamplingParams


def bench_params(request: BenchRequest, temperature: float, seed: int) -> SamplingParams:
    """Exactly ``output_len`` tokens (EOS ignored); seeded when sampling."""
    return SamplingParams(
        temperature=temperature,
        max_tokens=request.output_len,
        ignore_eos=True,
        seed=seed if temperature > 0 else None,
    )


def release_memory() -> None:
    """Free what a dropped engine held (its KV cache, CUDA graphs) before the next one loads."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_engine(engine_kwargs: dict[str, Any]) -> tuple[LLMEngine, float]:
    """A fresh engine (the previous one freed first) and its load time in seconds."""
    release_memory()
    start = time.perf_counter()
    engine = LLMEngine.from_kwargs(**engine_kwargs)
    warmup(engine)
    return engine, time.perf_counter() - start


def warmup(engine: LLMEngine) -> None:
    """One tiny request, so first-call costs stay out of the measurement."""
    engine.add_request("bench-warmup", "Warm up.", SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def engine_counters(engine: LLMEngine) -> dict[str, int]:
    """Running totals of the engine, to subtract before/after a run."""
    stats, blocks, spec = engine.stats, engine.block_manager, engine.spec_stats
    return {
        "num_spec_drafts": spec.num_drafts,
        "num_spec_draft_tokens": spec.num_draft_tokens,
        "num_spec_accepted_tokens": spec.num_accepted_tokens,
        "num_steps": stats.num_steps,
        "num_batched_seqs": stats.num_batched_seqs,
        "num_preemptions": getattr(engine.scheduler, "num_preemptions", 0),
        "num_prefix_queries": getattr(blocks, "num_prefix_queries", 0),
        "num_prefix_hits": getattr(blocks, "num_prefix_hits", 0),
    }


def engine_report(
    engine: LLMEngine, before: dict[str, int], max_kv_usage: float, max_seqs_per_step: int
) -> dict:
    """Batch and KV statistics of the run between ``before`` and now."""
    after = engine_counters(engine)
    delta = {k: after[k] - before[k] for k in after}
    steps = max(delta["num_steps"], 1)
    queries = delta["num_prefix_queries"]
    return {
        "num_steps": delta["num_steps"],
        "mean_seqs_per_step": delta["num_batched_seqs"] / steps,
        "max_seqs_per_step": max_seqs_per_step,
        "num_preemptions": delta["num_preemptions"],
        "prefix_hit_rate": delta["num_prefix_hits"] / queries if queries else 0.0,
        "max_kv_usage": max_kv_usage,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "kv_block_size": engine.block_manager.block_size,
    } | spec_report(delta)


def spec_report(delta: dict[str, int]) -> dict:
    """Speculative decoding over a run: acceptance rate and tokens per verifying step."""
    drafts, drafted = delta["num_spec_drafts"], delta["num_spec_draft_tokens"]
    if not drafts:
        return {}
    accepted = delta["num_spec_accepted_tokens"]
    return {
        "spec_num_drafts": drafts,
        "spec_acceptance_rate": accepted / drafted,
        "spec_mean_accepted_length": 1 + accepted / drafts,
    }


def spec_text(result: dict) -> str:
    if "spec_num_drafts" not in result:
        return ""
    return (
        f"speculative decoding: {result['spec_num_drafts']} drafts verified, acceptance rate "
        f"{100 * result['spec_acceptance_rate']:.1f}%, mean accepted length "
        f"{result['spec_mean_accepted_length']:.2f} tokens per step"
    )


class _Driver:
    """Adds requests when their time comes, steps the engine, times every new token."""

    def __init__(
        self,
        engine: LLMEngine,
        requests: Sequence[BenchRequest],
        offsets: list[float],
        temperature: float,
        loras: Sequence[LoRARequest | None] | None = None,
    ):
        self.engine, self.requests, self.offsets = engine, requests, offsets
        self.temperature = temperature
        self.loras = loras or [None] * len(requests)
        self.records = [RequestRecord(r.prompt_len) for r in requests]
        self.last_token = [0.0] * len(requests)
        self.index: dict[str, int] = {}  # request id -> position in requests
        self.max_kv_usage = 0.0
        self.max_seqs_per_step = 0
        self.start = time.monotonic()

    @property
    def num_added(self) -> int:
        return len(self.index)

    def is_done(self) -> bool:
        return self.num_added == len(self.requests) and not self.engine.has_unfinished_requests()

    def admit_due(self) -> None:
        now = time.monotonic() - self.start
        while self.num_added < len(self.requests) and self.offsets[self.num_added] <= now:
            i = self.num_added
            request_id = f"bench-{i}-{time.monotonic_ns()}"
            self.index[request_id] = i
            params = bench_params(self.requests[i], self.temperature, i)
            prompt = {"prompt_token_ids": self.requests[i].prompt_token_ids}
            self.engine.add_request(
                request_id,
                prompt,
                params,
                arrival_time=self.start + self.offsets[i],
                lora_request=self.loras[i],
            )
        if not self.engine.has_unfinished_requests() and self.num_added < len(self.requests):
            time.sleep(max(0.0, self.offsets[self.num_added] - now))

    def step(self) -> int:
        """One engine step; returns how many requests finished."""
        stats = self.engine.stats
        num_steps, num_seqs = stats.num_steps, stats.num_batched_seqs
        outputs = self.engine.step()
        if stats.num_steps == num_steps:
            time.sleep(0.0005)  # nothing scheduled (e.g. a dynamic batch still filling)
        self.max_seqs_per_step = max(self.max_seqs_per_step, stats.num_batched_seqs - num_seqs)
        now = time.monotonic() - self.start
        self.max_kv_usage = max(self.max_kv_usage, self.engine.block_manager.usage)
        for out in outputs:
            self._observe(self.index[out.request_id], len(out.outputs[0].token_ids), now)
        return sum(out.finished for out in outputs)

    def _observe(self, i: int, num_tokens: int, now: float) -> None:
        record = self.records[i]
        if num_tokens <= record.output_len:
            return
        if record.ttft is None:
            record.ttft = now - self.offsets[i]
        else:
            record.itls.append(now - self.last_token[i])
        record.output_len = num_tokens
        record.e2e = now - self.offsets[i]
        self.last_token[i] = now


def drive(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float] | None = None,
    temperature: float = 0.0,
    desc: str = "llmserve",
    use_tqdm: bool = True,
    loras: Sequence[LoRARequest | None] | None = None,
) -> tuple[list[RequestRecord], float, dict]:
    """Run ``requests`` (request i added ``offsets[i]`` s after start; default: all at once;
    with the LoRA adapter ``loras[i]``, where given).

    Returns the per-request records, the seconds from start to the last finish, and the batch /
    KV statistics of the run.
    """
    offsets = list(offsets) if offsets is not None else [0.0] * len(requests)
    before = engine_counters(engine)
    driver = _Driver(engine, requests, offsets, temperature, loras)
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not use_tqdm)
    try:
        with engine.compute_threads_bound():  # as LLM.generate and the server step
            while not driver.is_done():
                driver.admit_due()
                if engine.has_unfinished_requests():
                    bar.update(driver.step())
    except BaseException:
        engine.abort_request(list(driver.index))
        raise
    finally:
        bar.close()
    elapsed = time.monotonic() - driver.start
    report = engine_report(engine, before, driver.max_kv_usage, driver.max_seqs_per_step)
    return driver.records, elapsed, report

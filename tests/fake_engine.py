"""Drive the real scheduler and block manager with fake model outputs (no torch, no model)."""

from __future__ import annotations

import itertools

from llmserve.config import SchedulerConfig
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.scheduler_output import SchedulerOutput
from llmserve.engine.sequence import FinishReason, Request, Sequence
from llmserve.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int = 4,
    n: int = 1,
    priority: int = 0,
    arrival: float | None = None,
    prompt: list[int] | None = None,
) -> Request:
    prompt_ids = prompt if prompt is not None else [100 + (i % 50) for i in range(prompt_len)]
    request = Request(
        request_id, None, prompt_ids, SamplingParams(max_tokens=max_tokens, n=n), priority
    )
    if arrival is not None:
        request.metrics.arrival_time = arrival
    request.seqs = [Sequence(next(_ids), request, i, list(prompt_ids)) for i in range(n)]
    return request


class FakeEngine:
    """schedule -> fake sample (token = 7 + index) -> update -> finish at max_tokens."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        **sched,
    ):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, num_swap_blocks)
        self.scheduler = Scheduler(SchedulerConfig(**sched), self.bm)
        self.outputs: list[SchedulerOutput] = []

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.scheduler.add(r)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.outputs.append(out)
        samples = {
            s.seq.seq_id: [(7 + j, None) for j in range(s.num_samples)]
            for s in out.scheduled
            if s.num_samples
        }
        for sampled in self.scheduler.update(out, samples):
            seq = sampled.seq
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                self.scheduler.finish(seq, FinishReason.LENGTH)
        return out

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.scheduler.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps

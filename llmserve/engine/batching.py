"""Batching strategies: when may waiting requests join the running batch?

All three share the scheduler, the runner and the paged KV cache; they differ only here.

    static      take up to max_num_seqs requests as a group; admit nothing else until every
                sequence of the group has finished (finished slots stay empty meanwhile)
    dynamic     static, but a group starts only once max_num_seqs requests wait or the
                oldest has waited batch_wait_ms
    continuous  admit every step (the token budget decides); TGI's knobs may hold back:
                with B sequences running, admit only when >= floor(waiting_served_ratio x B)
                waiting requests fit, unless max_waiting_tokens decode steps passed without
                an admission
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from llmserve.config import SchedulerConfig
from llmserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from llmserve.engine.scheduler import Scheduler


class BatchingPolicy:
    """Continuous batching, with TGI's ``waiting_served_ratio`` / ``max_waiting_tokens``."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.steps_without_admission = 0

    def may_admit(self, scheduler: Scheduler, budget: int) -> bool:
        """Decide, once per step, whether waiting sequences may be admitted."""
        num_running = len(scheduler.running)
        ratio = self.config.waiting_served_ratio
        if num_running == 0 or ratio <= 0:
            return True
        if self.steps_without_admission >= self.config.max_waiting_tokens:
            return True
        needed = math.floor(ratio * num_running)
        return scheduler.count_admittable(budget) >= needed

    def is_admissible(self, seq: Sequence) -> bool:
        return True

    def after_step(self, num_admitted: int) -> None:
        self.steps_without_admission = 0 if num_admitted else self.steps_without_admission + 1


class StaticBatchingPolicy(BatchingPolicy):
    """Groups of up to ``max_num_seqs`` sequences that run until all of them finish."""

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        self.group: set[str] = set()  # request ids of the current group

    def may_admit(self, scheduler: Scheduler, budget: int) -> bool:
        alive = {r for r in self.group if r in scheduler.requests}
        if alive:
            self.group = alive
            return True  # members not yet running (chunked in, or preempted) may join
        if not scheduler.waiting or not self.group_may_start(scheduler):
            self.group = set()
            return False
        self.group = self._take_group(scheduler)
        return True

    def group_may_start(self, scheduler: Scheduler) -> bool:
        return True

    def is_admissible(self, seq: Sequence) -> bool:
        return seq.request.request_id in self.group

    def _take_group(self, scheduler: Scheduler) -> set[str]:
        group: set[str] = set()
        num_seqs = 0
        for seq in scheduler.waiting:
            size = len(seq.request.seqs)
            if num_seqs + size > self.config.max_num_seqs:
                break
            group.add(seq.request.request_id)
            num_seqs += size
        return group


class DynamicBatchingPolicy(StaticBatchingPolicy):
    """Static groups that start when full or when the oldest request waited long enough."""

    def group_may_start(self, scheduler: Scheduler) -> bool:
        num_waiting = sum(len(s.request.seqs) for s in scheduler.waiting)
        if num_waiting >= self.config.max_num_seqs:
            return True
        oldest = min(s.request.arrival_time for s in scheduler.waiting)
        return (time.monotonic() - oldest) * 1000.0 >= self.config.batch_wait_ms


def make_policy(config: SchedulerConfig) -> BatchingPolicy:
    policies = {
        "continuous": BatchingPolicy,
        "static": StaticBatchingPolicy,
        "dynamic": DynamicBatchingPolicy,
    }
    return policies[config.batching](config)

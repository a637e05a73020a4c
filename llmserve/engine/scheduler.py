"""Continuous batching with a token budget (vLLM v1's rule), plain Python.

Every step hands out at most ``max_num_batched_tokens`` tokens over at most
``max_num_seqs`` sequences:

  1. running sequences first, in priority order: one token each for decodes, a chunk for
     prompts still being prefilled; when the pool is out of blocks, the least important
     running sequence is preempted: its blocks are freed and it goes back to the waiting
     queue, its KV copied to the swap space when there is one (it resumes where it stopped:
     a copy back, the CPU default) or dropped (recomputed later, the prefix cache
     permitting: ``--preemption-mode recompute``, and the CUDA default);
  2. then waiting sequences, while budget, sequence slots and blocks last; a prompt longer
     than the remaining budget is chunked over several steps. A sequence whose LoRA adapter
     would make more than ``max_loras`` adapters in the step waits (those after it may go).

Decodes and prefill chunks go into the same forward pass. With speculative decoding
(``spec_decode/``) a decode carries K drafted tokens too, verified in that same pass; only the
accepted ones count as computed, and the blocks past them are given back.

The interface is small:
``add`` -> ``schedule() -> SchedulerOutput`` -> ``update(output, samples)`` -> ``abort``.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from llmserve.config import SchedulerConfig
from llmserve.engine import beam_search
from llmserve.engine.batching import make_policy
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.scheduler_output import SampledSeq, ScheduledSeq, SchedulerOutput
from llmserve.engine.sequence import FinishReason, Request, Sequence, SequenceStatus
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.scheduling import SpeculativeScheduling
from llmserve.spec_decode.stats import SpecDecodeStats


class Scheduler:
    """Decides which sequences run each step; owns the waiting and running queues."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        speculative: SpeculativeConfig | None = None,
        max_loras: int = 1,
    ):
        self.config = config
        self.max_loras = max_loras  # LoRA adapters in one step (llmserve/lora/)
        self.block_manager = block_manager
        self.speculative = speculative
        self.spec_stats = SpecDecodeStats()
        self.spec = None  # drafts for decodes, and the rollback after verification
        if speculative is not None:
            self.spec = SpeculativeScheduling(speculative, block_manager, self.spec_stats)
        self.waiting: list[Sequence] = []  # sorted by self._key
        self.running: list[Sequence] = []  # sorted by self._key
        self.requests: dict[str, Request] = {}
        self._finished_seq_ids: list[int] = []
        self.num_preemptions = 0
        self.policy = make_policy(config)  # batching strategy: who may join the batch
        # a draft model's KV pool would need swapping too: its sequences are recomputed
        self.can_swap = block_manager.num_swap_blocks > 0 and not (
            speculative is not None and speculative.uses_draft_model
        )

    # ---- interface ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._insert(self.waiting, request.seqs[0])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        try:
            budget = self._schedule_running(out, self.config.max_num_batched_tokens)
            num_admitted = 0
            if out.num_preempted == 0 and self.waiting and self.policy.may_admit(self, budget):
                num_admitted = self._schedule_waiting(out, budget)
        finally:
            self.block_manager.in_step.clear()  # valid while this one step is planned
        self.policy.after_step(num_admitted)
        # One query token = decode attention (query at the last position), whatever its kind;
        # drafts to verify run as decode rows too (runner/inputs.py).
        out.scheduled.sort(key=lambda s: s.num_tokens != 1 and not s.num_spec_tokens)
        out.blocks_to_copy = self.block_manager.take_blocks_to_copy()
        out.blocks_to_swap_out, out.blocks_to_swap_in = self.block_manager.take_swaps()
        out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        return out

    def update(
        self,
        out: SchedulerOutput,
        samples: dict[int, list[tuple[int, Any]]],
        eos_token_id: int | None = None,
    ) -> list[SampledSeq]:
        """Advance sequences by what the runner computed; ``samples`` maps seq_id -> tokens
        (for a beam: its candidate tokens and their log-probabilities)."""
        sampled: list[SampledSeq] = []
        beam_groups: dict[str, list[Sequence]] = {}
        for item in out.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            if item.num_spec_tokens:
                sampled.extend(self.spec.accept(item, samples[seq.seq_id]))
                continue
            seq.num_computed_tokens += item.num_tokens
            self.block_manager.cache_full_blocks(seq)
            if item.num_samples == 0:
                continue
            if seq.request.params.use_beam_search:
                beam_groups.setdefault(seq.request.request_id, []).append(seq)
                continue
            tokens = samples[seq.seq_id]
            targets = self._fork(seq) if item.num_samples > 1 else [seq]
            for target, (token_id, logprobs) in zip(targets, tokens):
                target.token_ids.append(token_id)
                if target.grammar is not None:
                    target.grammar.consume_token(token_id)
                sampled.append(SampledSeq(target, token_id, logprobs, target.num_output_tokens))
        for stepped in beam_groups.values():
            sampled.extend(self._beam_step(stepped, samples, eos_token_id))
        return sampled

    def _beam_step(
        self, stepped: list[Sequence], samples: dict, eos_token_id: int | None
    ) -> list[SampledSeq]:
        """Choose a request's next beams from its candidates (engine/beam_search.py)."""
        request = stepped[0].request
        params, state = request.params, request.beam
        request.is_forked = True
        queued = {id(s) for s in self.waiting + self.running}
        waiting = [s for s in request.seqs if s not in stepped and id(s) in queued]
        beams = [(s, s.cumulative_logprob, s.output_token_ids, samples[s.seq_id]) for s in stepped]
        width = params.n - len(waiting)  # preempted siblings keep their places
        continuations, finished = beam_search.select(beams, width, eos_token_id, params.ignore_eos)
        state.hypotheses.extend(finished)
        plan, spare = beam_search.assign(continuations, request.seqs, waiting)
        for target, c in plan:
            if target is not c.parent:
                self._become_fork(target, c.parent)
        sampled = []
        for target, c in plan:
            target.token_ids.append(c.token_id)
            target.cumulative_logprob = c.cumulative_logprob
            sampled.append(SampledSeq(target, c.token_id, None, target.num_output_tokens))
        for seq in spare:  # pruned: its blocks go back now
            self.finish(seq, FinishReason.STOP)
        best = continuations[0].cumulative_logprob if continuations else None
        length = len(stepped[0].output_token_ids) + 1
        if beam_search.is_done(state, best, length, params.n, params.length_penalty):
            for seq in request.seqs:
                self.finish(seq, FinishReason.STOP)
            return []
        return sampled

    def _become_fork(self, child: Sequence, parent: Sequence) -> None:
        """Turn ``child`` (pruned or not yet started) into a copy of ``parent``'s beam."""
        self.block_manager.free(child)
        self._copy_progress(child, parent)
        if child.status is not SequenceStatus.RUNNING:
            child.finish_reason = None
            self._start_running(child)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End one sequence and free its blocks."""
        if seq.is_finished:
            return
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        if seq in queue:
            queue.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self._finished_seq_ids.append(seq.seq_id)
        if seq.request.is_finished:
            self.requests.pop(seq.request.request_id, None)

    def abort(self, request_id: str) -> bool:
        """Abort every sequence of a request; returns False for an unknown id."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        for seq in request.seqs:
            self.finish(seq, FinishReason.ABORT)
        return True

    # ---- running ------------------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: set[int] = set()
        speculate = self.spec is not None and self.spec.pays(self.running)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted in this loop
                continue
            if speculate and self.spec.schedule(seq, budget, out):
                scheduled.add(seq.seq_id)
                budget -= out.scheduled[-1].num_tokens
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_tokens, scheduled, out):
                continue
            self.block_manager.allocate(seq, num_tokens)
            self.block_manager.offer_in_step(seq, num_tokens)
            out.scheduled.append(ScheduledSeq(seq, num_tokens, self._num_samples(seq, num_tokens)))
            scheduled.add(seq.seq_id)
            budget -= num_tokens
        return budget

    def _make_room(
        self, seq: Sequence, num_tokens: int, scheduled: set[int], out: SchedulerOutput
    ) -> bool:
        """Preempt the least important unscheduled sequences until ``seq`` fits."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victims = [s for s in self.running if s.seq_id not in scheduled]
            victim = victims[-1]  # running is sorted: the last is the least important
            self._preempt(victim)
            out.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it again: swapped out when the swap space takes it
        (beams excepted: they trade blocks among themselves), else to be recomputed."""
        self.running.remove(seq)
        if (
            self.can_swap
            and not seq.request.params.use_beam_search
            and self.block_manager.can_swap_out(seq)
        ):
            self.block_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
        else:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.draft_num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self._insert(self.waiting, seq)

    # ---- waiting ------------------------------------------------------------------------
    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in queue order while budget, slots and blocks last."""
        num_seqs = self._num_running_seqs()
        num_admitted = 0
        loras: set[int] | None = None  # the step's LoRA adapters, found once one is asked for
        for seq in [s for s in self.waiting if self.policy.is_admissible(s)]:
            lora = seq.request.lora_int_id
            if lora and loras is None:
                loras = {s.request.lora_int_id for s in self.running} - {0}
            if lora and lora not in loras and len(loras) >= self.max_loras:
                continue
            if (
                budget == 0
                or num_seqs + 1 + seq.request.num_pending_forks > self.config.max_num_seqs
            ):
                break
            num_tokens = self._try_admit(seq, budget)
            if num_tokens == 0:
                break
            out.scheduled.append(ScheduledSeq(seq, num_tokens, self._num_samples(seq, num_tokens)))
            if lora:
                loras.add(lora)
            num_seqs += 1 + seq.request.num_pending_forks
            num_admitted += 1
            budget -= num_tokens
        return num_admitted

    def _try_admit(self, seq: Sequence, budget: int) -> int:
        """Move ``seq`` to running with blocks for its first chunk; 0 if it does not fit."""
        if seq.status is SequenceStatus.SWAPPED:
            return self._try_swap_in(seq, budget)
        if not seq.block_ids and seq.request.params.prompt_logprobs is None:
            seq.num_computed_tokens = self.block_manager.acquire_cached_prefix(seq)
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
        num_tokens = min(seq.num_uncomputed_tokens, budget)
        chunk_refused = (
            num_tokens < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill
        )
        if chunk_refused or not self.block_manager.can_allocate(seq, num_tokens):
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            return 0
        self.waiting.remove(seq)
        self.block_manager.allocate(seq, num_tokens)
        self.block_manager.offer_in_step(seq, num_tokens)
        self._start_running(seq)
        if seq.request.metrics.first_scheduled_time is None:
            seq.request.metrics.first_scheduled_time = time.monotonic()
        return num_tokens

    def _try_swap_in(self, seq: Sequence, budget: int) -> int:
        """Resume a swapped sequence where it stopped (its KV copied back); 0 if no room."""
        num_tokens = min(seq.num_uncomputed_tokens, budget)
        if not self.block_manager.can_swap_in(seq, num_tokens):
            return 0
        self.waiting.remove(seq)
        self.block_manager.swap_in(seq, num_tokens)
        self._start_running(seq)
        return num_tokens

    def count_admittable(self, budget: int) -> int:
        """How many waiting sequences would fit now (prefix-cache hits not counted)."""
        num_seqs, free_blocks, count = (
            self._num_running_seqs(),
            self.block_manager.num_free_blocks,
            0,
        )
        for seq in self.waiting:
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            held = seq.num_computed_tokens if seq.status is SequenceStatus.SWAPPED else 0
            blocks = self.block_manager.num_blocks_for(held + num_tokens)
            slots = 1 + seq.request.num_pending_forks
            if budget == 0 or blocks > free_blocks or num_seqs + slots > self.config.max_num_seqs:
                break
            budget, free_blocks, num_seqs, count = (
                budget - num_tokens,
                free_blocks - blocks,
                num_seqs + slots,
                count + 1,
            )
        return count

    def _num_running_seqs(self) -> int:
        return sum(1 + s.request.num_pending_forks for s in self.running)

    # ---- helpers ------------------------------------------------------------------------
    def _num_samples(self, seq: Sequence, num_tokens: int) -> int:
        if num_tokens < seq.num_uncomputed_tokens:
            return 0
        return 1 + seq.request.num_pending_forks

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Start the request's other sequences on ``parent``'s blocks."""
        request = parent.request
        for child in request.seqs[1:]:
            self._copy_progress(child, parent)
            self._start_running(child)
        request.is_forked = True
        return request.seqs

    def _copy_progress(self, child: Sequence, parent: Sequence) -> None:
        """``child`` takes ``parent``'s tokens and progress, on ``parent``'s KV blocks."""
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.draft_num_computed_tokens = parent.draft_num_computed_tokens
        self.block_manager.fork(parent, child)

    def _key(self, seq: Sequence) -> tuple:
        request = seq.request
        if self.config.scheduling_policy == "priority":
            return (request.priority, request.arrival_time, seq.seq_id)
        return (request.arrival_time, seq.seq_id)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self._insert(self.running, seq)

    def _insert(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self._key)

"""The model runner: builds flat tensors from the scheduler's output, runs the model, samples.

Nothing here lives across steps except the weights, the KV pool and the per-sequence random
generators: every step's tensors are rebuilt from the ``SchedulerOutput`` (runner/inputs.py).

    scheduled:  [d0] [d1] [p0 chunk: 3 tokens] [p1 chunk: 2 tokens] [s0: t d1 d2 d3]
    input_ids:   t    t    t  t  t              t  t                 t  d1 d2 d3
    logits:      1    1    -                    1                    4 (verified, spec_decode/)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from llmserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from llmserve.layers.attention_metadata import AttentionMetadata
from llmserve.lora.manager import LoRAManager
from llmserve.outputs import Logprob
from llmserve.runner import kv_cache
from llmserve.runner.cuda_graph import CUDAGraphRunner
from llmserve.runner.inputs import Chunk, StepInputs, build_step_inputs
from llmserve.runner.logprobs import compute_prompt_logprobs
from llmserve.runner.sampler import OutputTokens, Sampler, SamplingRow, sampler_kernels
from llmserve.spec_decode import rejection_sampler
from llmserve.spec_decode.draft_model import DraftModelProposer, Proposal
from llmserve.structured_output.masking import apply_grammar_masks

logger = logging.getLogger(__name__)

Sample = tuple[int, dict[int, Logprob] | None]  # token id, logprobs


@dataclass
class RunnerOutput:
    """Per sequence id: the sampled tokens (n for a fork step); prompt logprobs per request."""

    samples: dict[int, list[Sample]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)


class ModelRunner:
    """Owns the model and the KV pool; ``execute`` runs one scheduled step."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches,
        block_size: int,
        device: torch.device,
        eos_token_id: int | None,
        attention_backend: str,
        cuda_graphs: CUDAGraphRunner | None = None,
        drafter: DraftModelProposer | None = None,
        swap: kv_cache.SwapSpace | None = None,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.eos_token_id = eos_token_id
        self.attention_backend = attention_backend
        self.sampler = Sampler(sampler_kernels(attention_backend))
        self.generators: dict[int, torch.Generator] = {}
        self.cuda_graphs = cuda_graphs  # decode-only steps replay a captured graph (CUDA)
        self.drafter = drafter  # speculative decoding with a draft model
        self.swap = swap  # where preempted sequences' KV waits (--preemption-mode swap)
        self.lora: LoRAManager | None = None  # LoRA adapters (--enable-lora), set by the worker

    @property
    def num_swap_blocks(self) -> int:
        return 0 if self.swap is None else self.swap.num_blocks

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for seq_id in sched.finished_seq_ids:
            self.generators.pop(seq_id, None)
        if self.swap is not None:  # swap-outs first: their blocks may be handed out again
            self.swap.swap_out(self.kv_caches, sched.blocks_to_swap_out)
            self.swap.swap_in(self.kv_caches, sched.blocks_to_swap_in)
        kv_cache.copy_blocks(self.kv_caches, sched.blocks_to_copy)
        drafts = self._propose(sched.scheduled)
        inputs = self.prepare_inputs(sched.scheduled, drafts)
        if self.lora is not None:
            items = sched.scheduled
            rows = [item.seq.request.lora_int_id for item in items for _ in range(item.num_tokens)]
            self.lora.prepare(rows, inputs.meta.output_rows)
        if self.cuda_graphs and self.cuda_graphs.can_use(inputs.meta):
            hidden = self.cuda_graphs.forward(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta
            )  # [T, hidden]
        out = RunnerOutput()
        self._sample(sched.scheduled, inputs.logits_rows(hidden), drafts, out)
        self._prompt_logprobs(sched.scheduled, hidden, inputs.meta, out)
        return out

    # ---- inputs -------------------------------------------------------------------------
    def _propose(self, scheduled: list[ScheduledSeq]) -> dict[int, Proposal]:
        """Drafts of this step's speculating sequences: n-gram ones came with the schedule,
        the draft model makes its own (and keeps its KV pool in step with the blocks)."""
        speculating = [s for s in scheduled if s.num_spec_tokens]
        if not speculating:
            return {}
        if self.drafter is None:
            return {s.seq.seq_id: (s.spec_token_ids, None) for s in speculating}
        return self.drafter.propose(
            speculating, lambda item, drafts: self._row(item, item.seq, drafts)
        )

    def prepare_inputs(
        self, scheduled: list[ScheduledSeq], drafts: dict[int, Proposal] | None = None
    ) -> StepInputs:
        chunks = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            tokens = seq.token_ids[start : start + item.num_tokens - item.num_spec_tokens]
            if item.num_spec_tokens:
                tokens = tokens + drafts[seq.seq_id][0]
            num_logits = 1 + item.num_spec_tokens if item.num_samples else 0
            verify = item.num_spec_tokens > 0  # as decode rows: the scheduler put it among them
            chunks.append(Chunk(tokens, start, seq.block_ids, num_logits, as_decodes=verify))
        every_row = any(_wants_prompt_logprobs(item) for item in scheduled)
        return build_step_inputs(
            chunks, self.block_size, self.device, self.attention_backend, not every_row
        )

    # ---- sampling -----------------------------------------------------------------------
    def _sample(
        self,
        scheduled: list[ScheduledSeq],
        hidden: torch.Tensor,
        drafts: dict[int, Proposal],
        out: RunnerOutput,
    ) -> None:
        """``hidden``: the logits rows' hidden states ``[num_logits, hidden]``."""
        sampling = [s for s in scheduled if s.num_samples]
        if not sampling:
            return
        logits = self.model.compute_logits(hidden)  # [num_logits, vocab]
        if drafts:  # speculating sequences have K + 1 rows each; verify them apart
            logits, sampling = self._verify(sampling, logits, drafts, out)
            if not sampling:
                return
        is_beam = [s.seq.request.params.use_beam_search for s in sampling]
        if any(is_beam):
            beam_rows = [i for i, b in enumerate(is_beam) if b]
            self._beam_candidates([sampling[i] for i in beam_rows], logits[beam_rows], out)
            rest = [i for i, b in enumerate(is_beam) if not b]
            if not rest:
                return
            sampling, logits = [sampling[i] for i in rest], logits[rest]
        row_of: list[int] = []
        rows: list[SamplingRow] = []
        grammars = []
        for i, item in enumerate(sampling):
            targets = (
                item.seq.request.seqs[: item.num_samples] if item.num_samples > 1 else [item.seq]
            )
            for target in targets:
                row_of.append(i)
                rows.append(self._row(item, target))
                grammars.append(target.grammar)
        if len(rows) != len(sampling):
            logits = logits[torch.tensor(row_of, device=logits.device)]  # forks: one row per child
        logits = apply_grammar_masks(logits, grammars)  # structured output
        result = self.sampler(logits, rows)
        k = 0
        for item in sampling:  # a fork step samples one row per child: num_samples rows
            out.samples[item.seq.seq_id] = [
                (result.sampled_token_ids[j], result.logprobs[j])
                for j in range(k, k + item.num_samples)
            ]
            k += item.num_samples

    def _verify(
        self,
        sampling: list[ScheduledSeq],
        logits: torch.Tensor,
        drafts: dict[int, Proposal],
        out: RunnerOutput,
    ) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Accept or reject the drafts; returns the other sequences and their logits rows."""
        plain_rows, plain, spec_rows, checks = [], [], [], []
        row = 0
        for item in sampling:
            if not item.num_spec_tokens:
                plain_rows.append(row)
                plain.append(item)
                row += 1
                continue
            tokens, q = drafts[item.seq.seq_id]
            rows = [self._row(item, item.seq, tokens[:j]) for j in range(len(tokens) + 1)]
            checks.append((item, rejection_sampler.Verification(tokens, q, rows)))
            spec_rows.extend(range(row, row + len(rows)))
            row += len(rows)
        index = torch.tensor(spec_rows, device=logits.device)
        results = rejection_sampler.verify(
            logits[index], [v for _, v in checks], self.sampler.kernels
        )
        for (item, _), samples in zip(checks, results, strict=True):
            out.samples[item.seq.seq_id] = samples
        return logits[torch.tensor(plain_rows, device=logits.device, dtype=torch.long)], plain

    def _beam_candidates(
        self, items: list[ScheduledSeq], logits: torch.Tensor, out: RunnerOutput
    ) -> None:
        """Per beam: its 2 x width best next tokens and their log-probabilities (log-softmax
        of the raw logits, EOS then masked with ignore_eos: transformers' order)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        for row, item in enumerate(items):
            params = item.seq.request.params
            if params.ignore_eos and self.eos_token_id is not None:
                logprobs[row, self.eos_token_id] = float("-inf")
            top = logprobs[row].topk(min(2 * params.n, logprobs.shape[-1]))
            out.samples[item.seq.seq_id] = list(
                zip(top.indices.tolist(), top.values.tolist(), strict=True)
            )

    def _row(self, item: ScheduledSeq, target, drafts: list[int] = ()) -> SamplingRow:
        """Sampling row of ``target``'s next token; after ``drafts`` when verifying them."""
        seq = item.seq
        return SamplingRow(
            params=seq.request.params,
            prompt_token_ids=seq.request.prompt_token_ids,
            output_token_ids=OutputTokens(seq.token_ids, seq.num_prompt_tokens, drafts),
            generator=self._generator(target),
            eos_token_id=self.eos_token_id,
        )

    def _generator(self, seq) -> torch.Generator | None:
        seed = seq.request.params.seed
        if seed is None:
            return None
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((seed * 1_000_003 + seq.index) % (1 << 63))
            self.generators[seq.seq_id] = gen
        return gen

    def _prompt_logprobs(
        self,
        scheduled: list[ScheduledSeq],
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        out: RunnerOutput,
    ) -> None:
        for i, item in enumerate(scheduled):
            seq, request = item.seq, item.seq.request
            if not _wants_prompt_logprobs(item):
                continue
            start = seq.num_computed_tokens
            end = min(start + item.num_tokens, seq.num_prompt_tokens - 1)  # last predicts output
            if end <= start:
                continue
            base = sum(meta.query_lens_cpu[:i])
            logits = self.model.compute_logits(hidden[base : base + end - start]).float()
            targets = seq.token_ids[start + 1 : end + 1]
            num = request.params.prompt_logprobs
            out.prompt_logprobs[request.request_id] = compute_prompt_logprobs(logits, targets, num)


def _wants_prompt_logprobs(item: ScheduledSeq) -> bool:
    """Whether this step computes prompt logprobs for ``item`` (its first sequence, before it
    has output): the step's every hidden row is then read, not only the logits rows."""
    seq = item.seq
    return (
        seq.request.params.prompt_logprobs is not None
        and seq.index == 0
        and not seq.num_output_tokens
    )

"""CUDA graphs for decode-only steps: capture once per batch-size bucket, replay every step.

A decode step launches a few hundred small kernels (per layer: norms, projections, rotary,
KV write, attention); at small batches the CPU launch overhead, not the GPU, sets the step
time. A CUDA graph records the launches once and replays them with one call. A graph fixes
every shape and every pointer, so the inputs live in static buffers sized for the largest
bucket, and a step of ``n`` sequences is padded up to the smallest bucket ``>= n``:

    buckets: 1 2 4 8 16 24 32 ... max_num_seqs     step with n = 5 -> bucket 8

    row          0    1    2    3    4  | 5    6    7      (padding rows)
    input_ids    t    t    t    t    t  | 0    0    0
    positions    p    p    p    p    p  | 0    0    0
    slot_mapping s    s    s    s    s  | -1   -1   -1     -1: the KV write skips the row
    seq_lens     L    L    L    L    L  | 0    0    0      0: attention writes zeros
    block_tables [row of each sequence] | (stale, never read when seq_len is 0)

Only the Triton backend can be captured: the torch backend sizes its gather tensors from the
batch's context lengths, which change every step. Nothing here runs on CPU.
"""

from __future__ import annotations

import logging
import time

import torch

from llmserve.layers.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURED_BATCH = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs``.

    The last bucket is ``max_num_seqs`` itself (rounded up to a multiple of 8 past 8), so
    every decode batch the scheduler can form has a bucket; capped at MAX_CAPTURED_BATCH.
    """
    limit = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s < limit]
    top = limit if limit <= 8 else -(-limit // 8) * 8
    sizes += list(range(16, top, 8)) + [top]
    return sorted(set(sizes))


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` sequences, or None if none does."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


class CUDAGraphRunner:
    """Captures the model's decode forward per bucket and replays it on padded static inputs.

    ``fill`` (pure tensor copies, testable on CPU) moves one step's inputs into the static
    buffers; ``capture`` and ``forward`` need CUDA.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        max_bs = self.sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            max_bs, self.max_blocks, dtype=torch.int32, device=device
        )  # [max_bs, max_blocks]
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> [bucket, hidden] static output

    def can_use(self, meta: AttentionMetadata) -> bool:
        """A decode-only step whose batch has a captured bucket and fits the static table
        (and wants every row's output: the graphs were captured without ``output_rows``)."""
        return (
            bool(self.graphs)
            and meta.output_rows is None
            and meta.num_decodes == meta.num_seqs
            and meta.num_seqs <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> int:
        """Copy a decode step into the static buffers, padding it to its bucket; returns the bucket."""
        n = meta.num_seqs
        bucket = bucket_for(n, self.sizes)
        assert bucket is not None and meta.num_decodes == n
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[n:bucket].zero_()
        return bucket

    def static_meta(self, bucket: int) -> AttentionMetadata:
        """Metadata over the static buffers for a decode batch of ``bucket`` rows."""
        return AttentionMetadata(
            num_decodes=bucket,
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            max_query_len=1,
            max_seq_len=self.max_blocks,  # not read by the decode kernel
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=[0] * bucket,  # only its length (num_seqs) is read on this path
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first, all sharing one memory pool.

        Every captured row is padding (slot -1, seq_len 0), so warm-up and capture write
        nothing into the KV pool.
        """
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        for bucket in reversed(self.sizes):
            meta = self.static_meta(bucket)
            args = (self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
            self.model(*args)  # warm-up: compiles the Triton kernels for this shape
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.model(*args)  # [bucket, hidden]
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (batch sizes %s..%s) in %.1f s",
            len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - start,
        )  # fmt: skip

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the bucket's graph; returns hidden states ``[num_seqs, hidden]``."""
        bucket = self.fill(input_ids, positions, meta)
        self.graphs[bucket].replay()
        return self.outputs[bucket][: meta.num_seqs]

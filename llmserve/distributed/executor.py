"""Tensor-parallel execution: rank 0 runs the engine, ranks 1..N-1 mirror its model calls.

    engine process (rank 0)                         worker process (rank r)
    -----------------------                         -----------------------
    ModelRunner.execute(sched)                      loop:
      model(ids, positions, meta)  --"forward"-->     model(ids, positions, meta)
         all-reduces, per layer    <---gloo/nccl-->      all-reduces, per layer
      model.compute_logits(rows)   --"logits"--->     model.compute_logits(rows)
         all-gather of the vocab   <------------->       all-gather of the vocab
      sampler (rank 0 only)

The scheduler, the sampler and the outputs stay in rank 0; a step costs the workers one small
message (token ids, positions, block tables, slots) per model call. Workers are local
processes started by ``workers.py`` (spawned, or forked from a forkserver) or, under torchrun,
the ranks > 0 of the same command.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import traceback
import weakref
from typing import Any

import torch
import torch.distributed as dist

from llmserve.config import EngineConfig
from llmserve.distributed import process_group as pg
from llmserve.distributed.layers import apply_tensor_parallel
from llmserve.distributed.plan import TensorParallelPlan, check_devices, local_config, make_plan
from llmserve.distributed.weights import shard_weights
from llmserve.distributed.workers import WorkerSet
from llmserve.layers.paged_attention_torch import build_plan
from llmserve.loader import ResolvedModel
from llmserve.quantization import loading as quantization
from llmserve.runner import kv_cache
from llmserve.runner.model_runner import ModelRunner
from llmserve.runner.worker import (
    kv_spec,
    load_drafter,
    load_model,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from llmserve.spec_decode.draft_model import DraftModelProposer

logger = logging.getLogger(__name__)


def create_tp_runner(
    resolved: ResolvedModel,
    hf_config,
    config: EngineConfig,
    max_model_len: int,
    eos_token_id: int | None,
    drafter: tuple | None = None,
) -> tuple[TensorParallelRunner, int, str]:
    """``runner/worker.create_runner`` for ``tensor_parallel_size > 1``: check the split and
    the devices, start the workers, load rank 0's shard; returns (runner, num_blocks, info)."""
    size = config.parallel.tensor_parallel_size
    plan = make_plan(hf_config, size)
    device = resolve_device(config.device.device)
    device_type = device.type
    dtype = resolve_dtype(config.model.dtype, device)
    quantization.resolve_quantization(config.model.quantization, resolved, device, dtype)
    info = pg.torchrun_rank_info()
    if info is not None and info.world_size != size:
        raise ValueError(
            f"torchrun started {info.world_size} processes but --tensor-parallel-size is {size}"
        )
    if dist.is_initialized():
        raise ValueError(
            "this process already belongs to a torch.distributed group (another tensor-parallel "
            "engine?); drop that engine (del llm) or call its runner.shutdown() first"
        )
    is_spawned = info is None
    if is_spawned:
        info = pg.RankInfo(0, size, 0, size, "127.0.0.1", pg.free_port())
    check_devices(size, device_type, info.local_world_size)
    args = (resolved, hf_config, config, max_model_len, eos_token_id, plan, device_type)
    if not info.is_driver:  # a torchrun rank > 0: serve rank 0 until it stops, then exit
        run_worker(info, *args)
        raise SystemExit(0)
    workers = WorkerSet(info, args, _worker_entry) if is_spawned else None
    group = _join_watching(info, device_type, workers)
    runner, num_blocks, text = build_rank_runner(info, group, *args, drafter=drafter)
    if workers is not None:
        workers.wait_ready()
    return TensorParallelRunner(runner, group, workers), num_blocks, text


def build_rank_runner(
    info: pg.RankInfo,
    group,
    resolved: ResolvedModel,
    hf_config,
    config: EngineConfig,
    max_model_len: int,
    eos_token_id: int | None,
    plan: TensorParallelPlan,
    device_type: str,
    drafter: tuple | None = None,
) -> tuple[ModelRunner, int, str]:
    """This rank's shard of the model and of the KV pool (as many blocks as every rank).
    ``drafter`` (rank 0 only): a speculative draft model, loaded whole on rank 0 with its own
    KV pool of as many blocks; it proposes there and only the target's verification forward
    is split over the ranks."""
    pg.split_cpu_threads(info)
    device = pg.rank_device(device_type, info)
    dtype = resolve_dtype(config.model.dtype, device)
    backend = resolve_attention_backend(config.device.attention_backend, device, dtype)
    shard = plan.shards[info.rank]
    local = local_config(hf_config, shard)
    # The Llama family's tensors are cut by checkpoint name as they stream; a decoder.py
    # family's model cuts each one itself after its layout change (local.tp_shard).
    select = None if hasattr(local, "tp_shard") else (lambda stream: shard_weights(stream, shard))
    model = load_model(  # the rank's smaller model, filled slice by slice
        resolved, local, config, max_model_len, dtype, device, backend, select=select
    )
    apply_tensor_parallel(model, shard, hf_config.vocab_size, plan.world_size)
    attn = model.layers[0].self_attn
    cache_dtype = kv_cache.resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, backend)
    spec = kv_cache.KVCacheSpec(
        hf_config.num_hidden_layers,
        plan.max_kv_heads,
        attn.head_dim,
        cache_dtype,
        config.cache.block_size,
    )
    block_bytes = spec.bytes_per_block
    if drafter is not None:
        draft_model = load_drafter(drafter, config, max_model_len, dtype, device, backend)
        draft_spec = kv_spec(draft_model, drafter[1], cache_dtype, config.cache.block_size)
        block_bytes += draft_spec.bytes_per_block
    num_blocks = torch.tensor([kv_cache.kv_cache_budget(config.cache, device) // block_bytes])
    dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN, group=group)  # budgets differ per GPU
    num_blocks = int(num_blocks.item())
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget holds no block of {spec.bytes_per_block} bytes on some rank; "
            "raise --kv-cache-memory or --gpu-memory-utilization"
        )
    local_spec = dataclasses.replace(spec, num_kv_heads=attn.num_kv_heads)
    caches = kv_cache.allocate(local_spec, num_blocks, device, backend)
    proposer = None
    if drafter is not None:
        draft_caches = kv_cache.allocate(draft_spec, num_blocks, device, backend)
        proposer = DraftModelProposer(draft_model, draft_caches, spec.block_size, device, backend)
    runner = ModelRunner(
        model, caches, spec.block_size, device, eos_token_id, backend, drafter=proposer
    )
    weights = quantization.describe_weight_bytes(quantization.weight_bytes_by_dtype(model))
    text = (
        f"model {resolved.display_name}, tensor parallel {plan.world_size} on {device_type} "
        f"({dtype}, attention: {backend}); rank {info.rank} holds q heads {shard.q_heads}, KV "
        f"heads {shard.kv_heads}, MLP columns {shard.intermediate}, vocab rows {shard.vocab}, "
        f"{weights}; " + kv_cache.describe(local_spec, num_blocks, max_model_len) + " (per rank)"
    )
    if drafter is not None:
        text += f"; draft model {drafter[0].display_name} whole on rank 0, its own KV pool"
    return runner, num_blocks, text


def _join_watching(info: pg.RankInfo, device_type: str, workers: WorkerSet | None):
    """Join the group; while waiting for the others, fail fast if a spawned worker dies."""
    result: dict[str, Any] = {}

    def join() -> None:
        try:
            result["group"] = pg.init_process_group(info, device_type)
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        if workers is not None:
            workers.check_started()
    if "error" in result:
        raise result["error"]
    return result["group"]


# ---- rank 0 ---------------------------------------------------------------------------------
class DriverModel:
    """Rank 0's model: each call is first announced to the workers, then run here."""

    def __init__(self, model: torch.nn.Module, group) -> None:
        self.model = model
        self.group = group

    def __call__(self, input_ids, positions, kv_caches, meta):
        plan_free = dataclasses.replace(meta, plan=None)
        broadcast(
            ("forward", _to_cpu(input_ids), _to_cpu(positions), _meta_to(plan_free, "cpu")),
            self.group,
        )
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        broadcast(("logits", _to_cpu(hidden)), self.group)
        return self.model.compute_logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class TensorParallelRunner:
    """The engine's runner under tensor parallelism: a ``ModelRunner`` whose model calls are
    mirrored on the workers. ``shutdown`` (or garbage collection, or exit) stops them."""

    def __init__(self, runner: ModelRunner, group, workers: WorkerSet | None) -> None:
        self.runner = runner
        self.group = group
        self.workers = workers
        runner.model = DriverModel(runner.model, group)
        self._finalizer = weakref.finalize(self, _stop_workers, group, workers)

    def execute(self, sched):
        if self.workers is not None:
            self.workers.check_alive()
        if sched.blocks_to_copy:
            broadcast(("copy_blocks", list(sched.blocks_to_copy)), self.group)
        return self.runner.execute(sched)

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (a new engine may form another)."""
        self._finalizer()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def _stop_workers(group, workers: WorkerSet | None) -> None:
    try:
        broadcast(("stop",), group)
    except RuntimeError:  # a worker already gone (a signal reached the whole group)
        logger.debug("tensor-parallel workers were gone before the stop message")
    finally:
        if workers is not None:
            workers.join()
        dist.destroy_process_group()


def broadcast(message: tuple, group) -> tuple:
    """Rank 0 sends ``message`` to every rank; the others receive it (pass ``()``)."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()


def _meta_to(meta, device):
    tensors = {
        f.name: getattr(meta, f.name).to(device)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    return dataclasses.replace(meta, **tensors)


# ---- ranks 1..N-1 -----------------------------------------------------------------------------
def run_worker(info: pg.RankInfo, *args) -> None:
    """Join the group, load this rank's shard, then mirror rank 0's model calls until "stop"."""
    device_type = args[-1]
    group = pg.init_process_group(info, device_type)
    runner, _, _ = build_rank_runner(info, group, *args)
    serve_steps(runner, group)
    dist.destroy_process_group()


@torch.inference_mode()
def serve_steps(runner: ModelRunner, group) -> None:
    model, device, caches = runner.model, runner.device, runner.kv_caches
    native = runner.attention_backend == "cpp"
    while True:
        message = broadcast((), group)
        kind = message[0]
        if kind == "forward":
            _, input_ids, positions, meta = message
            meta = _meta_to(meta, device)
            if runner.attention_backend in ("torch", "cpp"):
                meta.plan = build_plan(meta, runner.block_size, native_decode=native)
            model(input_ids.to(device), positions.to(device), caches, meta)
        elif kind == "logits":
            model.compute_logits(message[1].to(device))
        elif kind == "copy_blocks":
            kv_cache.copy_blocks(caches, message[1])
        elif kind == "stop":
            return


def _worker_entry(info: pg.RankInfo, args: tuple, status) -> None:
    """Spawned worker: report "ready" (or the error) to rank 0 through ``status``."""
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the group; rank 0 stops us
    try:
        device_type = args[-1]
        group = pg.init_process_group(info, device_type)
        runner, _, _ = build_rank_runner(info, group, *args)
        status.put((info.rank, None))
    except BaseException:
        status.put((info.rank, traceback.format_exc()))
        raise
    serve_steps(runner, group)
    dist.destroy_process_group()

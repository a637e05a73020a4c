"""Which slice of every weight a tensor-parallel rank holds, and the checks that refuse a split.

Heads are split by KV group, so that every rank's query heads read KV heads it holds:

    9 q heads, 3 KV heads (groups of 3), N = 2:   rank 0: KV {0, 1}, q 0-5    rank 1: KV {2}, q 6-8
    4 q heads, 1 KV head,  N = 2 (KV < N):        rank 0: KV {0}, q 0-1       rank 1: KV {0}, q 2-3

With at least as many KV heads as ranks, the KV heads are dealt out contiguously (uneven
counts allowed: the 2/1 above); with fewer, each KV head is replicated on N / num_kv_heads
ranks, which needs N to be a multiple of the KV heads and the query heads to divide by N.
MLP columns must divide evenly; the vocabulary is padded up to a multiple of N.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

# Tensor parallelism covers the Llama family (models/llama.py: its checkpoint tensors are cut
# by name as they stream, weights.shard_weights) and every models/decoder.py family (the rank's
# model is built from a smaller spec, and cuts each tensor in our names after the family's own
# layout changes, weights.cut_for_rank: fused or per-head qkv, Conv1D, experts). A mixture of
# experts is split like a dense MLP: every rank holds every expert with its share of the
# expert's columns, and the router is replicated (vLLM's tensor-parallel MoE).


@dataclass(frozen=True)
class ModelDims:
    """What a split is computed from, read from the family's own config names."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    expert_intermediate: int | None
    vocab: int


@dataclass(frozen=True)
class RankShard:
    """One rank's ranges, as [start, end) over heads, MLP columns and vocabulary rows."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # real rows; the local table has ``vocab_per_rank`` rows (padded)
    vocab_per_rank: int
    head_dim: int
    expert_intermediate: tuple[int, int] | None = None  # each expert's columns (MoE models)
    rank: int = 0  # rank 0 adds the biases of the row-parallel layers (o_proj, down_proj)
    num_heads: int = 0  # the whole model's (to cut a fused [q; k; v] checkpoint tensor)
    num_kv_heads: int = 0


@dataclass(frozen=True)
class TensorParallelPlan:
    """The split of one model over ``world_size`` ranks (see the module docstring)."""

    world_size: int
    shards: tuple[RankShard, ...]

    @property
    def max_kv_heads(self) -> int:
        """KV heads of the fullest rank: every rank sizes its pool by it (same block count)."""
        return max(s.kv_heads[1] - s.kv_heads[0] for s in self.shards)


def validate_parallel(config: Any) -> None:
    """Checks of the parallel flags alone, before anything is loaded (``EngineConfig.validate``)."""
    parallel = config.parallel
    for name in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(parallel, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(parallel, name)}")
    if parallel.data_parallel_size > 1 and parallel.distributed_executor_backend == "mp":
        raise ValueError(
            "data-parallel replicas run as Ray actors: use --distributed-executor-backend ray "
            "(or leave it unset) with --data-parallel-size > 1"
        )
    is_data_parallel = parallel.data_parallel_size > 1
    if parallel.distributed_executor_backend == "ray" and not is_data_parallel:
        raise ValueError(
            "--distributed-executor-backend ray runs data-parallel replicas: use it with "
            "--data-parallel-size > 1 (tensor-parallel ranks are local processes or torchrun's)"
        )
    if parallel.ray_address is not None and not is_data_parallel:
        raise ValueError("--ray-address is for data-parallel replicas (--data-parallel-size > 1)")
    if parallel.tensor_parallel_size == 1:
        return
    speculative = config.speculative
    if speculative is not None and speculative.uses_draft_model and speculative.model is None:
        raise ValueError(
            'a target drafting for itself (draft_model without a "model") shares its KV pool '
            "and weights, which tensor parallelism splits over ranks; with "
            '--tensor-parallel-size > 1 use {"method": "ngram"} or a separate draft '
            '"model" (it runs whole on rank 0)'
        )


def model_dims(hf_config: Any) -> ModelDims:
    """Heads, MLP and vocabulary sizes of ``hf_config``'s model (a decoder.py family's from its
    spec, which knows the family's config names), or a clear error if layers differ."""
    from llmserve.models.decoder import DecoderLM
    from llmserve.models.decoder_spec import MoEConfig
    from llmserve.models.registry import get_model_class

    model_class = get_model_class(hf_config)
    if not issubclass(model_class, DecoderLM):  # models/llama.py: Llama's config names
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        return ModelDims(
            heads, kv_heads, head_dim, hf_config.intermediate_size, None, hf_config.vocab_size
        )
    spec = model_class.build_spec(hf_config)
    shapes = {(a.num_heads, a.num_kv_heads, a.head_dim) for a in spec.attention}
    dense = {m.intermediate_size for m in spec.mlp if not isinstance(m, MoEConfig)}
    experts = {m.intermediate_size for m in spec.mlp if isinstance(m, MoEConfig)}
    if len(shapes) > 1 or len(dense) > 1 or len(experts) > 1:
        raise ValueError(
            f"tensor parallelism needs the same heads and MLP size in every layer; "
            f"{model_class.__name__} here has attention {sorted(shapes)} and MLP "
            f"{sorted(dense | experts)}: run it with --tensor-parallel-size 1"
        )
    (heads, kv_heads, head_dim), expert = shapes.pop(), (experts.pop() if experts else None)
    return ModelDims(
        heads, kv_heads, head_dim, dense.pop() if dense else expert, expert, spec.vocab_size
    )


def rank_spec(spec: Any, shard: RankShard) -> Any:
    """The ``models.decoder_spec.DecoderSpec`` of one rank's model: its query and KV heads (and
    their ALiBi slopes), MLP or expert columns and vocabulary rows."""
    from llmserve.layers.self_attention import AttentionConfig
    from llmserve.models.decoder_spec import MLPConfig, MoEConfig

    (q0, q1), (kv0, kv1) = shard.q_heads, shard.kv_heads

    def attention(a: AttentionConfig) -> AttentionConfig:
        slopes = None if a.alibi_slopes is None else a.alibi_slopes[q0:q1]
        return replace(a, num_heads=q1 - q0, num_kv_heads=kv1 - kv0, alibi_slopes=slopes)

    def mlp(m: MLPConfig | MoEConfig) -> MLPConfig | MoEConfig:
        start, end = shard.intermediate
        if isinstance(m, MoEConfig) and shard.expert_intermediate is not None:
            start, end = shard.expert_intermediate
        return replace(m, intermediate_size=end - start)

    return replace(
        spec,
        vocab_size=shard.vocab_per_rank,
        attention=[attention(a) for a in spec.attention],
        mlp=[mlp(m) for m in spec.mlp],
    )


def make_plan(hf_config: Any, world_size: int) -> TensorParallelPlan:
    """Split ``hf_config``'s model over ``world_size`` ranks, or say which size does not divide."""
    dims = model_dims(hf_config)
    num_heads, num_kv_heads, head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
    inter, vocab, n = dims.intermediate, dims.vocab, world_size
    if num_kv_heads < n and n % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {n} cannot split the model's {num_kv_heads} KV heads: with "
            "fewer KV heads than ranks each is replicated, so the size must be a multiple of "
            f"{num_kv_heads} (or at most {num_kv_heads})"
        )
    if num_kv_heads < n and num_heads % n:
        raise ValueError(
            f"tensor_parallel_size {n} does not divide the model's {num_heads} attention heads "
            f"(with {num_kv_heads} KV heads, fewer than the ranks, the query heads split evenly)"
        )
    expert_inter = dims.expert_intermediate
    for name, size in (("intermediate size", inter), ("expert intermediate size", expert_inter)):
        if size is not None and size % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the model's {name} {size} "
                "(MLP columns are split evenly)"
            )
    group = num_heads // num_kv_heads
    per_rank_vocab = -(-vocab // n)
    shards = []
    for rank in range(n):
        if num_kv_heads >= n:
            kv = _even_range(num_kv_heads, n, rank)
            q = (kv[0] * group, kv[1] * group)
        else:
            kv_head = rank // (n // num_kv_heads)
            kv = (kv_head, kv_head + 1)
            q = (rank * num_heads // n, (rank + 1) * num_heads // n)
        rows = (min(rank * per_rank_vocab, vocab), min((rank + 1) * per_rank_vocab, vocab))
        span = (rank * inter // n, (rank + 1) * inter // n)
        experts = None
        if expert_inter is not None:
            experts = (rank * expert_inter // n, (rank + 1) * expert_inter // n)
        shards.append(
            RankShard(
                q, kv, span, rows, per_rank_vocab, head_dim, experts, rank, num_heads, num_kv_heads
            )
        )
    return TensorParallelPlan(n, tuple(shards))


def _even_range(total: int, n: int, rank: int) -> tuple[int, int]:
    """Contiguous split of ``total`` items; the first ``total % n`` ranks get one more."""
    base, extra = divmod(total, n)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_devices(world_size: int, device_type: str, local_world_size: int) -> None:
    """More ranks on this machine than devices (GPUs, or CPU cores) is refused up front."""
    if device_type == "cuda":
        count, what = torch.cuda.device_count(), "CUDA GPUs"
    else:
        count, what = usable_cpus(), "CPU cores (one rank needs at least one)"
    if local_world_size > count:
        raise ValueError(
            f"tensor_parallel_size {world_size} needs {local_world_size} ranks on this machine "
            f"but it has {count} {what}; lower --tensor-parallel-size or spread the ranks over "
            "machines with torchrun (docs/distributed.md)"
        )


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_config(hf_config: Any, shard: RankShard) -> Any:
    """A copy of the config that builds exactly one rank's (smaller) model: Llama's with
    smaller counts; a decoder.py family's carrying ``tp_shard``, which its spec applies."""
    from llmserve.models.decoder import DecoderLM
    from llmserve.models.registry import get_model_class

    local = copy.deepcopy(hf_config)
    if issubclass(get_model_class(hf_config), DecoderLM):
        local.tp_shard = shard
        return local
    local.num_attention_heads = shard.q_heads[1] - shard.q_heads[0]
    local.num_key_value_heads = shard.kv_heads[1] - shard.kv_heads[0]
    local.head_dim = shard.head_dim
    local.intermediate_size = shard.intermediate[1] - shard.intermediate[0]
    local.vocab_size = shard.vocab_per_rank
    return local

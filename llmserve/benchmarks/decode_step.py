"""A decode step of the model at batch B and context C, and where its time goes: the
``step`` part of ``python -m llmserve.benchmarks.attention`` (that module's docstring).

    decode_batch       a random K/V pool and one decode step's metadata (blocks shuffled)
    step_breakdown     one step (forward + LM head) timed whole and split by forward hooks
                       into attention / matmul / the rest, the matmuls per projection

The step fills the KV pool with random values instead of prefilling B x C tokens (attention
costs the same on any values) and lets every layer share one pool, so a 4k context at batch
32 fits in memory; each layer still reads all of its K/V.
"""

from __future__ import annotations

import statistics
import time

import torch

from llmserve.layers.attention import Attention
from llmserve.layers.attention_metadata import AttentionMetadata
from llmserve.layers.cpu_linear import PackedLinear
from llmserve.layers.paged_attention_torch import build_plan
from llmserve.runner.kv_cache import transposed_keys

LINEAR_TYPES = (torch.nn.Linear, PackedLinear)  # PackedLinear: oneDNN-packed fp32 on CPU


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- a synthetic decode batch ---------------------------------------------------------------
def decode_batch(
    batch: int,
    context: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    keys_transposed: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]:
    """A random K/V pool and the metadata of one decode step: ``batch`` sequences whose new
    token is position ``context - 1``, their blocks shuffled over the pool; K stored as the
    cpp backend stores it with ``keys_transposed`` (``kv_cache.allocate``)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    if keys_transposed:
        k_cache = transposed_keys(k_cache)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)  # [batch, blocks_per_seq]
    last = context - 1
    slots = tables[:, last // block_size].long() * block_size + last % block_size  # [batch]
    meta = AttentionMetadata(
        num_decodes=batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=slots.to(device),
        max_query_len=1,
        max_seq_len=context,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
    )
    return (k_cache, v_cache), meta


# ---- timing by forward hooks ---------------------------------------------------------------------
class OpTimer:
    """Accumulates wall time spent inside linear layers (matmul) and Attention calls, and per
    projection name (the last part of a linear's module name, summed over the layers): seconds
    and FLOPs in ``projections[name]``."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.totals = {"matmul": 0.0, "attention": 0.0}
        self.projections: dict[str, list[float]] = {}  # name -> [seconds, flops]
        self._start: dict[int, float] = {}
        for name, module in model.named_modules():
            kind = "matmul" if isinstance(module, LINEAR_TYPES) else None
            kind = "attention" if isinstance(module, Attention) else kind
            if kind:
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._exit_hook(kind, name.rsplit(".", 1)[-1]))

    def _enter(self, module, args) -> None:
        sync_device(self.device)
        self._start[id(module)] = time.perf_counter()

    def _exit_hook(self, kind: str, name: str):
        def hook(module, args, output) -> None:
            sync_device(self.device)
            seconds = time.perf_counter() - self._start.pop(id(module))
            self.totals[kind] += seconds
            if kind == "matmul":  # x [rows, in] @ W^T [in, out]: 2 * rows * in * out
                self.add_projection(name, seconds, 2.0 * args[0].numel() * module.out_features)

        return hook

    def add(self, kind: str, seconds: float) -> None:
        self.totals[kind] += seconds

    def add_projection(self, name: str, seconds: float, flops: float) -> None:
        entry = self.projections.setdefault(name, [0.0, 0.0])
        entry[0] += seconds
        entry[1] += flops

    def reset(self) -> None:
        self.totals = dict.fromkeys(self.totals, 0.0)
        self.projections = {}


# ---- the step ------------------------------------------------------------------------------------
def load_model(
    model: str | None,
    load_format: str,
    device: torch.device,
    backend: str,
    dtype: torch.dtype | None = None,
):
    """The model with its weights (or random ones for ``dummy``) and its config."""
    from llmserve.config import EngineConfig
    from llmserve.loader import load_config, resolve_model
    from llmserve.runner.worker import load_model as load

    resolved = resolve_model(model)
    hf_config = load_config(resolved)
    config = EngineConfig.from_kwargs(model=model, load_format=load_format)
    max_len = hf_config.max_position_embeddings
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    return load(resolved, hf_config, config, max_len, dtype, device, backend), hf_config


def step_breakdown(model, batch: int, context: int, repeats: int, block_size: int = 16) -> dict:
    """Time one decode step (forward + LM head) and split it into attention/matmul/other."""
    device = next(model.parameters()).device
    attn = model.layers[0].self_attn
    dtype = next(model.parameters()).dtype
    kv, meta = decode_batch(
        batch, context, block_size, attn.num_kv_heads, attn.head_dim, dtype, device,
        keys_transposed=attn.attn.backend == "cpp",
    )  # fmt: skip
    kv_caches = [kv] * len(model.layers)  # one pool shared by every layer (see module doc)
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (batch,), device=device)
    positions = torch.full((batch,), context - 1, device=device)
    timer = OpTimer(model, device)
    steps, projections = [], []
    for i in range(repeats + 1):  # the first step warms up
        timer.reset()
        start = time.perf_counter()
        with torch.inference_mode():
            if attn.attn.backend in ("torch", "cpp"):
                meta.plan = build_plan(meta, block_size, native_decode=attn.attn.backend == "cpp")
                timer.add("attention", time.perf_counter() - start)
            hidden = model(input_ids, positions, kv_caches, meta)
            hooked, projected = timer.totals["matmul"], dict(timer.projections)
            logits_start = time.perf_counter()
            model.compute_logits(hidden)  # all matmul, whether or not it goes through a hook
            sync_device(device)
            seconds = time.perf_counter() - logits_start
            timer.totals["matmul"] = hooked + seconds
            timer.projections = projected  # the LM head counted once, whole, as lm_head
            timer.add_projection("lm_head", seconds, 2.0 * batch * hidden.shape[-1] * vocab)
        total = time.perf_counter() - start
        if i:
            steps.append({"total": total, **timer.totals})
            projections.append({name: tuple(v) for name, v in timer.projections.items()})
    step_ms = statistics.median(s["total"] for s in steps) * 1e3  # parts: medians as well
    parts = {k: statistics.median(s[k] for s in steps) * 1e3 for k in ("attention", "matmul")}
    other = max(step_ms - parts["attention"] - parts["matmul"], 0.0)
    kv_bytes = 2 * batch * context * len(model.layers) * attn.num_kv_heads * attn.head_dim
    kv_bytes *= dtype.itemsize
    return {
        "batch": batch,
        "context": context,
        "step_ms": step_ms,
        "step_min_ms": min(s["total"] for s in steps) * 1e3,
        "attention_ms": parts["attention"],
        "matmul_ms": parts["matmul"],
        "other_ms": other,
        "attention_share": parts["attention"] / step_ms,
        "matmul_share": parts["matmul"] / step_ms,
        "other_share": other / step_ms,
        "kv_read_gbs": kv_bytes / parts["attention"] / 1e6,
        "projections": projection_rows(projections, batch, dtype.itemsize, step_ms),
    }


def projection_rows(
    steps: list[dict[str, tuple[float, float]]], rows: int, itemsize: int, step_ms: float
) -> list[dict]:
    """Per projection, summed over the layers: median ms per step, share of the step, GFLOP/s,
    and the weights' GB/s (a call of ``rows`` rows does 2 * rows FLOPs per weight element)."""
    table = []
    for name in steps[0]:
        ms = statistics.median(s[name][0] for s in steps) * 1e3
        flops = steps[0][name][1]
        weight_bytes = flops / (2 * rows) * itemsize
        gflops, weight_gbs = flops / ms / 1e6, weight_bytes / ms / 1e6
        table.append({"projection": name, "ms": ms, "share": ms / step_ms, "gflops": gflops,
                      "weight_gbs": weight_gbs})  # fmt: skip
    return table

"""``python -m llmserve.benchmarks.attention``: where a decode step's time goes, and how fast
the attention paths are.

CPU (always):
  step    one decode step of the model at batch B and context C (``--dtype``): time in
          attention (KV write, paged attention and its per-step plan; GB/s of K/V read), in
          matmuls (nn.Linear projections and the LM head) and in everything else (norms,
          rotary, activation, embedding, adds); the matmuls also one by one, summed over the
          layers (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head) with their GFLOP/s and
          weight GB/s, to hold against ``../shared/tools/roofline.py``
  paged   paged decode attention vs SDPA over the same K/V stored contiguously: the C++
          kernel (backend cpp, reads blocks in place) and the torch path (gathered tiles)
GPU (when CUDA is available; ``--skip-gpu`` to leave out):
  flash   FlashAttention prefill (Triton) vs materialized attention vs torch SDPA, N tokens
  decode  paged decode attention (Triton): K/V bytes read per second vs the HBM peak
  graphs  end-to-end decode throughput of a random-weight ~1B Llama with and without CUDA
          graphs (``--load-format dummy``), and whether their greedy tokens agree
  ``--sweep-tiles`` instead times every launch shape (TileConfig) of the two Triton kernels
          under CUDA events, prefill against SDPA timed the same way

The step's batch and its breakdown live in ``decode_step.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from llmserve.benchmarks.decode_step import decode_batch, load_model, step_breakdown, sync_device
from llmserve.benchmarks.report import format_table, machine_info, write_json
from llmserve.kernels import cpu as cpu_kernels
from llmserve.layers.paged_attention_torch import build_plan, paged_attention_torch
from llmserve.runner.worker import resolve_attention_backend


# ---- timing ---------------------------------------------------------------------------------
def time_ms(fn: Callable[[], Any], repeats: int, device: torch.device, warmup: int = 1) -> float:
    """Median wall time of ``fn`` in milliseconds (synchronized on CUDA)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        fn()
        sync_device(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def interleaved_ms(
    fns: dict[str, Callable[[], Any]], repeats: int, device: torch.device
) -> dict[str, list[float]]:
    """Wall times (ms) of several functions run in turn, so load from other processes on a
    shared machine hits them alike; one warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            sync_device(device)
            start = time.perf_counter()
            fn()
            sync_device(device)
            if i:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


# ---- CPU: paged vs contiguous ---------------------------------------------------------------
def paged_vs_contiguous(
    batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, repeats: int
) -> dict:
    """One layer's decode attention over blocks shuffled across the pool, by the C++ kernel
    (when it builds) and by the torch path, vs SDPA on the same K/V laid out contiguously per
    sequence, ``[batch, kv_heads, context, head_dim]``. ``paged_ms`` is the engine's path on
    this machine (C++ when available)."""
    device, block_size, scale = torch.device("cpu"), 16, head_dim**-0.5
    (k_cache, v_cache), meta = decode_batch(
        batch, context, block_size, num_kv_heads, head_dim, torch.float32, device
    )
    q = torch.randn(batch, num_heads, head_dim)  # [batch, H, D]
    tables = meta.block_tables.long()
    k = k_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()  # [B, kvh, C, D]
    v = v_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q_grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, kvh, G, D]
    new_kv = torch.empty(batch, num_kv_heads, head_dim)  # read by prefills only
    plans = {"torch": build_plan(meta, block_size)}
    if cpu_kernels.available():
        plans["cpp"] = build_plan(meta, block_size, native_decode=True)

    def paged(path: str) -> Callable[[], torch.Tensor]:
        plan = plans[path]
        return lambda: paged_attention_torch(q, new_kv, new_kv, k_cache, v_cache, meta, plan, scale)

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_grouped, k, v, scale=scale)

    reference = contiguous().reshape(q.shape)
    max_diff = max((paged(p)() - reference).abs().max().item() for p in plans)
    fns = {f"paged_{p}": paged(p) for p in plans} | {"contiguous": contiguous}
    times = interleaved_ms(fns, repeats, device)
    med = {name: statistics.median(t) for name, t in times.items()}
    engine_path = "paged_cpp" if "cpp" in plans else "paged_torch"
    plan_ms = time_ms(lambda: build_plan(meta, block_size), repeats, device)
    kv_bytes = 2 * k.numel() * k.element_size()
    return {
        "batch": batch,
        "context": context,
        "paged_path": engine_path.removeprefix("paged_"),
        "paged_ms": med[engine_path],
        "paged_torch_ms": med["paged_torch"],
        "paged_cpp_ms": med.get("paged_cpp"),
        "contiguous_sdpa_ms": med["contiguous"],
        "ratio": med[engine_path] / med["contiguous"],
        "ratio_torch": med["paged_torch"] / med["contiguous"],
        "paged_min_ms": min(times[engine_path]),
        "contiguous_sdpa_min_ms": min(times["contiguous"]),
        "ratio_of_min": min(times[engine_path]) / min(times["contiguous"]),
        "plan_ms_per_step": plan_ms,
        "kv_mib": kv_bytes / 2**20,
        "paged_gbs": kv_bytes / med[engine_path] / 1e6,
        "max_abs_diff": max_diff,
    }


# ---- driver ---------------------------------------------------------------------------------
def run_cpu(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    backend = resolve_attention_backend("auto", torch.device("cpu"), dtype)
    model, hf_config = load_model(args.model, args.load_format, torch.device("cpu"), backend, dtype)
    steps = [step_breakdown(model, args.batch, c, args.repeats) for c in args.contexts]
    attn = model.layers[0].self_attn
    shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    paged = [paged_vs_contiguous(args.batch, c, *shape, args.repeats) for c in args.contexts]
    return {"model": args.model or "default (SmolLM2-135M)", "threads": torch.get_num_threads(), "backend": backend,
            "dtype": args.dtype,
            "heads_kv_heads_head_dim": shape, "step": steps, "paged_vs_contiguous": paged}  # fmt: skip


def print_report(report: dict) -> None:
    if report.get("cpu"):
        print_cpu(report["cpu"])
    if report.get("gpu"):
        from llmserve.benchmarks.attention_gpu import print_gpu

        print_gpu(report["gpu"])


def print_cpu(cpu: dict) -> None:
    print(
        f"\nCPU decode step, batch {cpu['step'][0]['batch']}, {cpu['model']}, {cpu['dtype']}, "
        f"{cpu['threads']} threads, attention backend {cpu['backend']}"
    )
    cols = ("context", "step_ms", "step_min_ms", "attention_ms", "matmul_ms", "other_ms", "attention_share",
            "matmul_share", "other_share", "kv_read_gbs")  # fmt: skip
    print(format_table(cols, [[r[c] for c in cols] for r in cpu["step"]]))
    step = cpu["step"][0]
    print(f"\nits matmuls by projection, summed over the layers (context {step['context']})")
    cols = ("projection", "ms", "share", "gflops", "weight_gbs")
    print(format_table(cols, [[r[c] for c in cols] for r in step["projections"]]))
    print(
        "\nCPU decode attention, one layer: paged (C++ kernel; torch gathered tiles) vs SDPA on contiguous K/V"
    )
    cols = ("context", "paged_path", "paged_ms", "paged_torch_ms", "contiguous_sdpa_ms", "ratio",
            "ratio_torch", "ratio_of_min", "kv_mib", "paged_gbs", "max_abs_diff")  # fmt: skip
    print(format_table(cols, [[r[c] for c in cols] for r in cpu["paged_vs_contiguous"]]))


def _shape(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0].strip("`"))
    add_arguments(p)
    return p.parse_args(argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options, shared by ``python -m llmserve.benchmarks.attention`` and ``llmserve bench attention``."""
    p.add_argument("--model", default=None, help="model for the CPU step (default: SmolLM2)")
    p.add_argument("--load-format", default="dummy", choices=("auto", "dummy"),
                   help="dummy: random weights (same speed, no loading)")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="CPU step: the model's dtype (bf16: AVX512_BF16 / AMX)")  # fmt: skip
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--repeats", type=int, default=10, help="timed runs (medians reported)")
    p.add_argument("--skip-gpu", action="store_true", help="CPU measurements only")
    p.add_argument("--skip-cpu", action="store_true", help="GPU measurements only")
    p.add_argument("--prefill-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--decode-shapes", type=_shape, nargs="+", default=[(32, 1024), (64, 4096)],
                   help="BATCHxCONTEXT pairs for the decode bandwidth")  # fmt: skip
    p.add_argument("--hbm-peak-gbs", type=float, default=None)
    p.add_argument("--graph-batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--graph-prompt-len", type=int, default=32)
    p.add_argument("--graph-output-len", type=int, default=128)
    p.add_argument("--sweep-tiles", action="store_true",
                   help="GPU: time every launch shape of the Triton kernels instead")  # fmt: skip
    p.add_argument("--output-json", default=None)


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> dict:
    report: dict[str, Any] = {"machine": machine_info(), "args": vars(args)}
    if not args.skip_cpu:
        report["cpu"] = run_cpu(args)
    if torch.cuda.is_available() and not args.skip_gpu:
        from llmserve.benchmarks.attention_gpu import run_gpu

        report["gpu"] = run_gpu(args)
    print_report(report)
    write_json(args.output_json, report)
    return report


if __name__ == "__main__":
    main()

"""``python -m llmserve.benchmarks.prompt_attention``: the C++ prompt (prefill) attention
kernel alone (``kernels.cpu.paged_attention``), per instruction-set path and KV dtype, in
GFLOP/s of the causal products.

A step of ``--batch`` whole prompts of ``--prompt-len`` tokens each, as chunked prefill hands
the kernel a step (2048 tokens: 8 prompts of 256), with the default model's heads (9 query
heads, 3 KV heads, head_dim 64), K stored as the cpp backend stores it and the blocks shuffled
(``decode_attention.make_batch``). Each call writes the prompts' K/V at their slots, then every
query row attends over its prompt up to itself. A prompt's K/V stay in the caches while its
rows re-read them, so this kernel is bound by its arithmetic, not by memory: compare the
GFLOP/s with the machine's fp32 matmul rate (``../shared/tools/roofline.py``). Counted: the
causal QK^T and PV products, 4 * heads * head_dim * L (L + 1) / 2 per prompt (with
``--window W``, a sliding window, the pairs each row sees: min(p + 1, W) for row p).
``--shape H KVH D`` sets the heads (Gemma 3 270M: 4 1 256).
``--sdpa-min-rows N`` hands prompts of N tokens or more to torch's SDPA inside the same call,
as the engine does in bf16 on CPUs with AMX (``kernels.cpu.prompt_sdpa_min_rows``); the
default, 0, times this library's kernel alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve.benchmarks.decode_attention import make_batch, parse_run_args
from llmserve.benchmarks.report import format_table
from llmserve.kernels import cpu as cpu_kernels

SHAPE = (9, 3, 64)  # query heads, KV heads, head_dim of the default model


def make_step(
    batch: int, prompt_len: int, block_size: int, dtype: torch.dtype, seed: int, shape=SHAPE
):
    """The arguments of ``cpu_kernels.paged_attention`` for ``batch`` whole prompts."""
    num_heads, num_kv_heads, head_dim = shape
    _, k_cache, v_cache, tables, seq_lens = make_batch(
        batch, prompt_len, block_size, dtype, shape, seed, keys_transposed=True
    )
    gen = torch.Generator().manual_seed(seed)
    tokens = batch * prompt_len
    q = torch.randn(tokens, num_heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads * head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, num_kv_heads * head_dim, generator=gen).to(dtype)
    positions = torch.arange(prompt_len)
    slots = tables.long()[:, positions // block_size] * block_size + positions % block_size
    query_start = torch.arange(0, tokens + 1, prompt_len, dtype=torch.int32)
    return q, k, v, k_cache, v_cache, slots.reshape(-1), tables, seq_lens, query_start


def measure(args: argparse.Namespace) -> list[dict]:
    num_heads, _, head_dim = shape = tuple(args.shape)
    window = args.window or args.prompt_len
    pairs = sum(min(p + 1, window) for p in range(args.prompt_len))  # per prompt and head
    flops = 4 * num_heads * head_dim * args.batch * pairs
    steps = {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        layers = [
            make_step(args.batch, args.prompt_len, args.block_size, dtype, seed, shape)
            for seed in range(args.layers)
        ]
        for isa in args.isas:
            steps[(dtype_name, isa)] = layers
    times: dict = {key: [] for key in steps}
    for _ in range(args.rounds):  # every configuration in turn, round after round
        for key, layers in steps.items():
            with cpu_kernels.forced_isa(key[1]):
                start = time.perf_counter()
                for step in layers:
                    cpu_kernels.paged_attention(
                        *step, head_dim**-0.5, args.sdpa_min_rows, args.window
                    )
                times[key].append(time.perf_counter() - start)
    rows = []
    for (dtype_name, isa), samples in times.items():
        seconds = statistics.median(samples) / args.layers
        rows.append({"dtype": dtype_name, "isa": isa, "ms_per_layer": seconds * 1e3,
                     "gflops": flops / seconds / 1e9})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0].strip("`"))
    p.add_argument("--batch", type=int, default=8, help="prompts in the step")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sdpa-min-rows", type=int, default=0,
                   help="prompts from this many tokens go to torch's SDPA (0: none; default 0, "
                        "this library's kernel alone)")  # fmt: skip
    p.add_argument("--shape", type=int, nargs=3, default=list(SHAPE),
                   metavar=("HEADS", "KV_HEADS", "HEAD_DIM"))  # fmt: skip
    p.add_argument("--window", type=int, default=0, help="a sliding window (0: none)")
    args = parse_run_args(p, argv, layers=4)
    rows = measure(args)
    print(
        f"prompt attention, {args.batch} prompts x {args.prompt_len} tokens, heads "
        f"{args.shape}, window {args.window or 'none'}, block size {args.block_size}, "
        f"{args.layers} layers, {torch.get_num_threads()} threads"
    )
    cols = ("dtype", "isa", "ms_per_layer", "gflops")
    print(format_table(cols, [[r[c] for c in cols] for r in rows]))
    return rows


if __name__ == "__main__":
    main()

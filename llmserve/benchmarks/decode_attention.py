"""``python -m llmserve.benchmarks.decode_attention``: the C++ paged decode attention kernel
alone, per instruction-set path, KV dtype and block size, in GB/s of K/V read.

Decode at batch B and context C with the default model's heads (9 query heads, 3 KV heads,
head_dim 64), the blocks shuffled across the pool as a long-running server leaves them, over
``--layers`` layers of separate caches (as a model step reads them: together larger than the
last-level cache, so K/V come from memory; one layer called repeatedly would be served from
cache and overstate the rate). Each configuration is timed in turn, round after round, so
load from other processes hits them alike (medians reported). Compare the GB/s with the
machine's streaming read rate: decode attention is memory-bound once the kernel keeps up.
``--pages huge`` allocates the pools as the engine does (``kv_cache.zeros``: transparent huge
pages where Linux gives them), ``4k`` as plain tensors, to show what the TLB costs.
``--block-orders`` adds block tables laid out otherwise: ``ascending`` (each sequence's blocks
one after another, as a fresh pool hands them out), ``descending`` (each sequence's blocks in
runs the wrong way round, as the block manager handed them out before it sorted them).
``--kv-dtypes`` stores the pools narrower than q (``--kv-cache-dtype``: bfloat16 under fp32 q,
float8_e4m3fn, float8_e5m2); GB/s counts the bytes read, so a narrower pool reads fewer of
them per token: compare ``ms_per_layer`` across pool dtypes.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from llmserve.benchmarks.report import format_table
from llmserve.kernels import cpu as cpu_kernels
from llmserve.runner import kv_cache


def make_batch(
    batch: int,
    context: int,
    block_size: int,
    dtype: torch.dtype,
    shape,
    seed: int,
    keys_transposed: bool = False,
    huge_pages: bool = True,
    order: str = "shuffled",
    kv_dtype: torch.dtype | None = None,
):
    """q, caches, shuffled block tables and lengths of a decode batch (every context C);
    ``kv_dtype``: the pools' dtype (default: q's);
    ``keys_transposed``: K stored as the cpp backend stores it (``kv_cache.allocate``);
    ``huge_pages``: the pools allocated as the engine allocates them (``kv_cache.zeros``);
    ``order``: shuffled, ascending or descending block tables (module doc)."""
    num_heads, num_kv_heads, head_dim = shape
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context // block_size)
    pool = batch * blocks + 8
    cache_shape = (pool, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(kv_dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(kv_dtype)
    if keys_transposed:
        k_cache = kv_cache.transposed_keys(k_cache)
    if huge_pages:
        cpu = torch.device("cpu")
        v_cache = kv_cache.zeros(cache_shape, kv_dtype, cpu).copy_(v_cache)
        stored = k_cache.permute(0, 2, 3, 1) if keys_transposed else k_cache  # as laid out
        k_cache = kv_cache.zeros(stored.shape, kv_dtype, cpu).copy_(stored)
        k_cache = k_cache.permute(0, 3, 1, 2) if keys_transposed else k_cache
    # drawn for every order, so q (drawn next) is the same whichever order is asked for
    tables = torch.randperm(pool, generator=gen)[: batch * blocks].view(batch, blocks).int()
    if order != "shuffled":
        tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
        tables = tables.flip(1) if order == "descending" else tables
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)  # [B, H, D]
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    return q, k_cache, v_cache, tables.contiguous(), seq_lens


def measure(args: argparse.Namespace) -> list[dict]:
    shape = (9, 3, 64)
    rows, fns = [], {}  # (context, dtype, block_size, isa) -> (layers' inputs, out, bytes read)
    for context in args.contexts:
        for dtype_name, kv_name in itertools.product(args.dtypes, args.kv_dtypes):
            dtype = getattr(torch, dtype_name)
            kv_dtype = dtype if kv_name == "same" else getattr(torch, kv_name)
            if kv_dtype.itemsize > dtype.itemsize:
                continue  # the kernels take pools as wide as q or narrower
            configs = itertools.product(
                args.block_sizes, args.k_layouts, args.pages, args.block_orders
            )
            for block_size, layout, pages, order in configs:
                transposed, huge = layout == "transposed", pages == "huge"
                layers = [
                    make_batch(
                        args.batch,
                        context,
                        block_size,
                        dtype,
                        shape,
                        seed,
                        transposed,
                        huge,
                        order,
                        kv_dtype,
                    )  # fmt: skip
                    for seed in range(args.layers)
                ]
                out = torch.empty_like(layers[0][0])
                # K and V of every context position of every layer, as read
                kv_bytes = (
                    2 * args.layers * args.batch * context * shape[1] * shape[2] * kv_dtype.itemsize
                )
                kv = str(kv_dtype).removeprefix("torch.")
                for isa in args.isas:
                    key = (context, dtype_name, kv, block_size, layout, pages, order, isa)
                    fns[key] = (layers, out, kv_bytes)
    times: dict = {key: [] for key in fns}
    for _ in range(args.rounds):
        for key, (layers, out, _) in fns.items():
            with cpu_kernels.forced_isa(key[-1]):
                start = time.perf_counter()
                for q, k, v, tables, lens in layers:
                    cpu_kernels.paged_decode_attention(q, k, v, tables, lens, 0.125, out)
                times[key].append(time.perf_counter() - start)
    for key, (_, _, nbytes) in fns.items():
        seconds = statistics.median(times[key])
        context, dtype_name, kv, block_size, layout, pages, order, isa = key
        rows.append({"context": context, "dtype": dtype_name, "kv_dtype": kv,
                     "block_size": block_size,
                     "k_layout": layout, "pages": pages, "blocks": order, "isa": isa, "ms_per_layer": seconds * 1e3 / args.layers,
                     "gbs": nbytes / seconds / 1e9})  # fmt: skip
    return rows


def parse_run_args(
    p: argparse.ArgumentParser, argv: list[str] | None, layers: int
) -> argparse.Namespace:
    """Add the options every attention-kernel benchmark takes (ISAs, threads, layers, rounds),
    parse, and apply ``--threads``; ``--isas`` defaults to every vector path this CPU runs
    (``avx2_w16``, a test path, left out)."""
    p.add_argument("--isas", nargs="+", default=None, help="default: every path this CPU runs")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--layers", type=int, default=layers, help="layers of separate K/V caches")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    fast_paths = [i for i in cpu_kernels.supported_isas() if i not in ("scalar", "avx2_w16")]
    args.isas = args.isas or fast_paths
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0].strip("`"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument(
        "--kv-dtypes",
        nargs="+",
        default=["same"],
        choices=["same", "bfloat16", "float8_e4m3fn", "float8_e5m2"],
        help="the pools' dtype: q's (same), or narrower (--kv-cache-dtype)",
    )
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    p.add_argument(
        "--k-layouts",
        nargs="+",
        default=["transposed", "tokens"],
        choices=["transposed", "tokens"],
        help="K blocks as the cpp backend stores them ([kv_heads, head_dim, block_size]) "
        "and/or token-major ([block_size, kv_heads, head_dim])",
    )
    p.add_argument(
        "--pages",
        nargs="+",
        default=["huge", "4k"],
        choices=["huge", "4k"],
        help="pools on transparent huge pages as the engine allocates them, and/or plain",
    )
    p.add_argument(
        "--block-orders",
        nargs="+",
        default=["shuffled"],
        choices=["shuffled", "ascending", "descending"],
        help="block tables shuffled across the pool (default), and/or each sequence's blocks "
        "in ascending or descending runs",
    )
    args = parse_run_args(p, argv, layers=8)
    rows = measure(args)
    threads = torch.get_num_threads()
    print(f"paged decode attention, batch {args.batch}, {args.layers} layers, {threads} threads")
    cols = ("context", "dtype", "kv_dtype", "block_size", "k_layout", "pages", "blocks", "isa",
            "ms_per_layer", "gbs")  # fmt: skip
    print(format_table(cols, [[r[c] for c in cols] for r in rows]))
    return rows


if __name__ == "__main__":
    main()

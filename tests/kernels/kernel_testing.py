"""Helpers for the kernel tests: a paged batch with its pool, a step's new K/V for it, the K
pool's layouts, ALiBi slopes, tolerances, a thread count for a block, the memory mapping that
holds an address, a bf16 linear's inputs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from llmserve.runner.kv_cache import transposed_keys


@dataclass
class PagedBatch:
    """A packed batch and the paged pool holding its context.

    Pool slots that no sequence position owns are NaN, so a kernel that reads past a
    sequence's end (or a padded block-table entry) poisons its output.
    """

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    keys: list[torch.Tensor]  # per sequence, contiguous [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    max_query_len: int


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random context for each sequence, scattered over shuffled blocks of a larger pool."""
    device = torch.get_default_device()  # built on the CPU (its generator), then moved there
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks no sequence owns
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = torch.full(shape, float("nan"), dtype=dtype)
        block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        keys, values = [], []
        for b, seq_len in enumerate(seq_lens):
            owned = [perm.pop() for _ in range(blocks_per_seq[b])]
            block_tables[b, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
            k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            for pos in range(seq_len):
                k_cache[owned[pos // block_size], pos % block_size] = k[pos]
                v_cache[owned[pos // block_size], pos % block_size] = v[pos]
            keys.append(k)
            values.append(v)
        query_start_loc = torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32
        )
        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
        batch = PagedBatch(
            q, k_cache, v_cache, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32),
            block_tables, keys, values, max(q_lens),
        )  # fmt: skip
    move = lambda t: t.to(device)  # noqa: E731
    return PagedBatch(
        move(batch.q), move(batch.k_cache), move(batch.v_cache), move(batch.query_start_loc),
        move(batch.seq_lens), move(batch.block_tables), [move(k) for k in batch.keys],
        [move(v) for v in batch.values], batch.max_query_len,
    )  # fmt: skip


def step_kv(batch: PagedBatch, q_lens: list[int], seq_lens: list[int]):
    """The K/V rows a step writes (each sequence's last q_len positions, ``[T, kvh * D]``),
    their pool slots, and copies of the pools with those slots NaN (the step must write them):
    ``(new_k, new_v, slot_mapping, k_cache, v_cache)``."""
    block_size, kv_heads, head_dim = batch.k_cache.shape[1:]
    slots = [
        int(batch.block_tables[b, p // block_size]) * block_size + p % block_size
        for b, (q_len, ctx) in enumerate(zip(q_lens, seq_lens))
        for p in range(ctx - q_len, ctx)
    ]
    new_k = torch.cat([k[ctx - q_len :] for k, q_len, ctx in zip(batch.keys, q_lens, seq_lens)])
    new_v = torch.cat([v[ctx - q_len :] for v, q_len, ctx in zip(batch.values, q_lens, seq_lens)])
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    slot_mapping = torch.tensor(slots)
    for cache in (k_cache, v_cache):
        cache.view(-1, kv_heads, head_dim)[slot_mapping] = float("nan")
    tokens = new_k.shape[0]
    return new_k.reshape(tokens, -1), new_v.reshape(tokens, -1), slot_mapping, k_cache, v_cache


LAYOUTS = ["tokens", "keys-transposed"]


def in_layout(k_cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The K pool as the cpp backend stores it (``kv_cache.allocate``): the same values, each
    block kept as [kv_heads, head_dim, block_size] behind the view."""
    if layout == "tokens":
        return k_cache
    transposed = transposed_keys(k_cache)
    assert not transposed.is_contiguous()
    torch.testing.assert_close(transposed, k_cache, equal_nan=True, rtol=0, atol=0)
    return transposed


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes (num_heads a power of two or not)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for kernel-vs-reference comparisons."""
    if dtype == torch.float32:
        return {"atol": 1e-4, "rtol": 1e-4}
    if dtype == torch.bfloat16:  # two bf16 ulps (2 x 2**-7): the sum and the output each round
        return {"atol": 2e-2, "rtol": 2e-2}
    return {"atol": 1e-2, "rtol": 1e-2}


def cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """[max_pos, rot_dim]: cos(pos * inv_freq) then sin(pos * inv_freq)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)  # [rot_dim // 2]
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]  # [max_pos, rot_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def bf16_inputs(m: int, k: int, n: int, with_bias: bool, seed: int):
    """x [m, k], w [n, k] and (with_bias) b [n] of a bf16 linear, standard normal, seeded."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    return x, w, b


@contextlib.contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads (the kernels' pool) set to ``threads`` inside the block."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def mapping_field(address: int, name: str) -> list[str]:
    """One field (``VmFlags:``, ``Rss:``, ...) of the mapping holding ``address``
    (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == name:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def mapping_flags(address: int) -> list[str]:
    return mapping_field(address, "VmFlags:")

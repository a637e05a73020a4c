"""The paged attention kernels of the C++ library (paged_attention.cpp) as Python functions:
decode attention reading the pool in place, a decode step's K/V write and attention in one
call, and any step (prompt chunks, causal), with when a prompt goes to torch's SDPA instead.
Re-exported by ``llmserve.kernels.cpu``."""

from __future__ import annotations

import functools

import torch

from llmserve.kernels.cpu import _direct

PROMPT_SDPA_MIN_ROWS = 128  # prompt_sdpa_min_rows


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q ``[n, H, D]`` (fp32 or bf16), caches ``[blocks, block_size, kvh, D]`` (q's dtype,
    bf16, or fp8 e4m3fn / e5m2 holding K / k_scale and V / v_scale), ``block_tables [n, >=
    ceil(len / block_size)]`` int32, ``seq_lens [n]`` int32 -> ``[n, H, D]`` in q's dtype
    (fp32 arithmetic). ``window`` > 0: a sliding window, the query (at position len - 1) sees
    the last ``window`` tokens only."""
    if out is None:
        out = torch.empty_like(q)
    _direct().paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, window, k_scale, v_scale
    )
    return out


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """A step of decodes in one call: ``k, v [T, kvh * D]`` written at ``slot_mapping`` (as
    ``k / k_scale`` and ``v / v_scale`` rounded to the pool's dtype where it is narrower),
    then ``q [T, H * D]`` attends over each sequence's blocks (its last ``window`` tokens if
    ``window`` > 0) -> ``[T, H * D]``."""
    return _direct().decode_attention(
        q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale, window,
        k_scale, v_scale,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sdpa_min_rows: int | None = None,
    window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Any step (prompt chunks and decodes) in one call: ``k, v [T, kvh * D]`` written at
    ``slot_mapping``, then sequence s's query rows ``q[query_start_loc[s]:query_start_loc[s +
    1]]`` (of ``q [T, H * D]``) attend causally over its ``seq_lens[s]`` tokens of context ->
    ``[T, H * D]``. ``block_tables [S, >= ceil(len / block_size)]``, ``seq_lens [S]`` and
    ``query_start_loc [S + 1]`` are int32. A prompt's first chunk of at least
    ``sdpa_min_rows`` rows (0: none; None: ``prompt_sdpa_min_rows`` for q's dtype) is attended
    by torch's SDPA instead of this library's kernel (not when it outgrows ``window``).
    ``window`` > 0: a sliding window, the row at position p sees tokens ``[p - window + 1,
    p]`` only. The pools' dtypes and ``k_scale`` / ``v_scale`` as ``decode_attention``'s; a
    pool narrower than q sends no prompt to SDPA by default (SDPA would read the step's K/V
    unrounded, runner/kv_cache.py)."""
    if sdpa_min_rows is None:
        sdpa_min_rows = prompt_sdpa_min_rows(q.dtype) if k_cache.dtype == q.dtype else 0
    return _direct().paged_attention(
        q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        sdpa_min_rows, window, k_scale, v_scale,
    )  # fmt: skip


@functools.cache
def prompt_sdpa_min_rows(dtype: torch.dtype) -> int:
    """From how many rows ``paged_attention`` hands a prompt's first chunk to torch's SDPA
    (0: never): bf16 on CPUs with AMX, whose flash attention runs its products as bf16 GEMMs
    on AMX tiles. Measured on an Intel Sapphire Rapids class VM (2 threads, the default
    model's heads, ``python -m llmserve.benchmarks.prompt_attention --sdpa-min-rows``), ms a
    layer, this library's kernel -> SDPA with its heads-first copies: one prompt of 64 tokens
    0.08 -> 0.09, 96 0.14 -> 0.13, 128 0.19 -> 0.17, 256 0.59 -> 0.38-0.41, 512 2.11 ->
    1.29; 8 x 256 4.95-5.49 -> 3.13, 2 x 1024 15.9-16.3 -> 6.3. fp32 there: SDPA 99-143
    GFLOP/s against this kernel's 114-162, so fp32 (and CPUs without AMX, not measured with
    SDPA) keep the kernel."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return PROMPT_SDPA_MIN_ROWS if dtype == torch.bfloat16 and amx else 0

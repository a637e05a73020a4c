"""Triton W4A16 / W8A16 dequantize-matmul: ``y = x @ W^T`` with W in llmserve's quantized layout.

One tiled kernel serves both prefill and decode. Each program owns a [BLOCK_M, BLOCK_N] output
tile and walks K one BLOCK_K tile at a time (BLOCK_K a multiple of 32, dividing K): it loads
the packed weight tile once, dequantizes it in registers (value * scale + min, in fp32), casts
it to x's dtype and accumulates ``x_tile @ w_tile^T`` in fp32 with tl.dot. For small M (decode)
the output has few tiles, so K is also split across programs (split-K) that write fp32
partials, summed on the host.

4-bit tiles are never interleaved in registers: the low nibbles of a 32-column packing block
are its columns 0..15 and the high nibbles its columns 16..31, so each weight tile feeds two
dots, one against the x columns of the low nibbles and one against those of the high:

    bytes of tile (BLOCK_K = 64):  jj =  0 ..... 15 | 16 ..... 31
    low nibble  -> column k0 +          0 ..... 15 | 32 ..... 47
    high nibble -> column k0 +         16 ..... 31 | 48 ..... 63

    grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), split_k)

lut (NF4/FP4 codes): its 16 int8 entries are packed into two int64 words once per program;
a code c reads byte c % 8 of word c // 8 (a shift and a mask, no gather).
perm (act-order, GPTQ's g_idx): x columns are read at ``perm[stored column]`` inside the
kernel, so x is never permuted in memory.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from llmserve.quantization.layout import QuantizedWeight

_MAX_SPLIT_K = 16
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class _TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Checked on an H100 with CUDA-graph timing (docs/benchmarks.md): these beat 8 warps with
# at most 4 K splits by 5-20% at M <= 16; not a full autotune.
# Decode (M <= 16) streams the weight once: a narrow N tile and a long K tile keep many
# bytes in flight per program, and split-K fills the 132 SMs when N alone gives few tiles.
# Mid M: 64x64 tiles. Prefill: 128x128x64, 8 warps, 3 stages (the dequantize work per tile
# is on the CUDA cores, so a deep pipeline of smem stages buys little past 3).
# Under TRITON_INTERPRET the small config keeps CPU tests fast and still exercises
# multi-tile masking in M and N.
_DECODE = _TileConfig(16, 64, 128, num_warps=4, num_stages=4)
_MEDIUM = _TileConfig(64, 64, 64, num_warps=4, num_stages=4)
_PREFILL = _TileConfig(128, 128, 64, num_warps=8, num_stages=3)
_INTERPRET = _TileConfig(16, 32, 64, num_warps=1, num_stages=1)


@triton.jit
def _lut_words(lut_ptr):
    """The 16 int8 lut entries as two int64 words: byte i of word w is lut[8w + i]."""
    idx = tl.arange(0, 16)
    entries = tl.load(lut_ptr + idx).to(tl.int64) & 0xFF  # [16] as unsigned bytes
    shifted = entries << ((idx % 8) * 8).to(tl.int64)
    lo = tl.sum(tl.where(idx < 8, shifted, 0), axis=0)  # disjoint bytes: the sum is an OR
    hi = tl.sum(tl.where(idx >= 8, shifted, 0), axis=0)
    return lo, hi


@triton.jit
def _code_values(codes, lut_lo, lut_hi, HAS_LUT: tl.constexpr):
    """4-bit codes [BLOCK_N, C] -> float32 values (lut[code], or the code itself)."""
    if HAS_LUT:
        c = codes.to(tl.int64)
        word = tl.where(c < 8, lut_lo, lut_hi)
        byte = (word >> ((c % 8) * 8)) & 0xFF
        return ((byte ^ 0x80) - 0x80).to(tl.float32)  # sign-extend the int8 entry
    return codes.to(tl.float32)


@triton.jit
def _load_x(x_ptr, perm_ptr, offs_m, m_mask, cols, stride_xm, stride_xk, HAS_PERM: tl.constexpr):
    """x at rows offs_m and stored columns cols: [BLOCK_M, C] (read at perm[cols] if act-order)."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols)  # [C] input feature of each stored column
    ptrs = x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk
    return tl.load(ptrs, mask=m_mask[:, None], other=0.0)


@triton.jit
def _dequantize(
    values,  # [BLOCK_N, C] float32
    scales_ptr,
    mins_ptr,
    offs_n,  # [BLOCK_N] int64
    n_mask,
    cols,  # [C] stored columns
    k0,
    stride_sn,
    GROUP_SIZE: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr,
):
    """values * scale + min of each weight's group, float32 [BLOCK_N, C]."""
    if ONE_GROUP:  # the whole K tile lies in one group: one scale per row
        s_offs = offs_n[:, None] * stride_sn + k0 // GROUP_SIZE  # [BLOCK_N, 1]
    else:
        s_offs = offs_n[:, None] * stride_sn + (cols // GROUP_SIZE)[None, :]  # [BLOCK_N, C]
    w = values * tl.load(scales_ptr + s_offs, mask=n_mask[:, None], other=0.0)
    if HAS_MINS:
        w += tl.load(mins_ptr + s_offs, mask=n_mask[:, None], other=0.0)
    return w


@triton.jit
def _dot_acc(acc, x, w, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + x [BLOCK_M, C] @ w[BLOCK_N, C]^T, w rounded to x's dtype first."""
    w = w.to(x.dtype)
    if UPCAST_DOT:  # the interpreter's dot multiplies bf16 bit patterns: do it in fp32 (exact)
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    mins_ptr,
    lut_ptr,
    perm_ptr,
    bias_ptr,
    out_ptr,  # [M, N], or [split_k, M, N] fp32 partials
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_sn,
    stride_os,
    stride_om,
    tiles_per_split,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_LUT: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    split = tl.program_id(2)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = qweight_ptr + offs_n[:, None] * stride_qn  # [BLOCK_N, 1]
    lut_lo = 0
    lut_hi = 0
    if HAS_LUT:
        lut_lo, lut_hi = _lut_words(lut_ptr)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, K // BLOCK_K)
    for tile in range(tile_start, tile_end):
        k0 = tile * BLOCK_K
        if BITS == 8:
            cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            q = tl.load(w_rows + cols[None, :], mask=n_mask[:, None], other=0)  # [BLOCK_N, BLOCK_K]
            x = _load_x(x_ptr, perm_ptr, offs_m, m_mask, cols, stride_xm, stride_xk, HAS_PERM)
            w = _dequantize(q.to(tl.float32), scales_ptr, mins_ptr, offs_n, n_mask, cols, k0,
                            stride_sn, GROUP_SIZE, ONE_GROUP, HAS_MINS)  # fmt: skip
            acc = _dot_acc(acc, x, w, UPCAST_DOT, DOT_PRECISION)
        else:
            jj = tl.arange(0, BLOCK_K // 2)  # byte within the tile
            packed = tl.load(w_rows + k0 // 2 + jj[None, :], mask=n_mask[:, None], other=0)
            lo_cols = k0 + (jj // 16) * 32 + jj % 16  # [BLOCK_K // 2] columns of low nibbles
            for half in tl.static_range(2):
                cols = lo_cols + 16 * half
                codes = (packed >> (4 * half)) & 0x0F  # [BLOCK_N, BLOCK_K // 2]
                x = _load_x(x_ptr, perm_ptr, offs_m, m_mask, cols, stride_xm, stride_xk, HAS_PERM)
                values = _code_values(codes, lut_lo, lut_hi, HAS_LUT)
                w = _dequantize(values, scales_ptr, mins_ptr, offs_n, n_mask, cols, k0,
                                stride_sn, GROUP_SIZE, ONE_GROUP, HAS_MINS)  # fmt: skip
                acc = _dot_acc(acc, x, w, UPCAST_DOT, DOT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _is_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


def _tile_config(m: int, k: int) -> _TileConfig:
    if _is_interpreted():
        cfg = _INTERPRET
    elif m <= 16:
        cfg = _DECODE
    elif m <= 64:
        cfg = _MEDIUM
    else:
        cfg = _PREFILL
    block_k = cfg.block_k
    while k % block_k:  # K is a multiple of 32, so this stops at 32 at the latest
        block_k //= 2
    return _TileConfig(cfg.block_m, cfg.block_n, block_k, cfg.num_warps, cfg.num_stages)


@functools.lru_cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_split_k(num_tiles: int, num_k_tiles: int, device: torch.device) -> int:
    """Enough K splits that the grid covers the GPU about twice (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    target = 2 * _num_sms(device.index if device.index is not None else 0)
    return max(1, min(_MAX_SPLIT_K, num_k_tiles, triton.cdiv(target, num_tiles)))


def _check_inputs(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    n, k = weight.shape
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}] (the weight's in_features), got {tuple(x.shape)}")
    want = {"qweight": torch.int8 if weight.bits == 8 else torch.uint8, "scales": torch.float32}
    want.update(mins=torch.float32, lut=torch.int8, perm=torch.int64)
    for name, dtype in want.items():
        t = getattr(weight, name)
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"weight.{name} is on {t.device} but x is on {x.device}")
        if t.dtype != dtype:
            raise ValueError(f"weight.{name} must be {dtype} for {weight.bits}-bit, got {t.dtype}")
    tables = [t for t in (weight.scales, weight.mins) if t is not None]
    if weight.qweight.stride(-1) != 1 or not all(t.is_contiguous() for t in tables):
        raise ValueError("weight.qweight rows, scales and mins must be contiguous")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(
            f"bias must be [{n}] on {x.device}, got {tuple(bias.shape)} on {bias.device}"
        )


def quant_matmul(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., N]`` in x's dtype, W dequantized on the fly.

    x: float16, bfloat16 or float32 on the weight's device. weight: 4- or 8-bit, any group
    size the layout allows, with optional mins, lut and perm. bias: ``[N]`` (any float dtype).
    split_k: K splits per output tile (None: picked from the shape; 1 off CUDA).
    Same result as ``layout.reference_linear`` up to the rounding of W to x's dtype.
    """
    _check_inputs(x, weight, bias)
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # [M, K], a view when x allows it (strides are passed)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return x.new_zeros(*lead, n)
    cfg = _tile_config(m, k)
    grid_mn = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    num_k_tiles = k // cfg.block_k
    if split_k is None:
        split_k = _default_split_k(grid_mn[0] * grid_mn[1], num_k_tiles, x.device)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    tiles_per_split = triton.cdiv(num_k_tiles, split_k)
    split_k = triton.cdiv(num_k_tiles, tiles_per_split)  # no split left without a K tile
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)  # partials
    _launch(x2, weight, bias if split_k == 1 else None, out, cfg, grid_mn, split_k, tiles_per_split)
    if split_k > 1:
        out = out.sum(0)  # [M, N] fp32
        if bias is not None:
            out += bias.float()
        out = out.to(x.dtype)
    return out.reshape(*lead, n)


def _launch(x, weight, bias, out, cfg, grid_mn, split_k, tiles_per_split) -> None:
    upcast = x.dtype == torch.bfloat16 and _is_interpreted()
    key = (cfg, x.dtype, weight.bits, weight.group_size, weight.mins is not None,
           weight.lut is not None, weight.perm is not None, bias is not None)  # fmt: skip
    stages = _STAGES.get(key, cfg.num_stages)
    while True:
        try:
            _launch_stages(
                x, weight, bias, out, cfg, grid_mn, split_k, tiles_per_split, upcast, stages
            )
            break
        except OutOfResources:
            if stages == 1:
                raise
            stages -= 1  # that pipeline's shared memory exceeds this GPU's: a shallower one
    _STAGES[key] = stages


# Pipeline depth that fits shared memory, per kernel specialization, found at first launch
# (the 4-stage decode tile with fp32 x or per-group mins needs more than an H100's 227 KiB).
_STAGES: dict[tuple, int] = {}


def _launch_stages(x, weight, bias, out, cfg, grid_mn, split_k, tiles_per_split, upcast, stages):
    m, k = x.shape
    n = weight.shape[0]
    stride_os = out.stride(0) if out.dim() == 3 else 0
    placeholder = weight.scales  # any tensor, for pointer args of absent inputs
    _quant_matmul_kernel[(*grid_mn, split_k)](
        x, weight.qweight, weight.scales,
        placeholder if weight.mins is None else weight.mins,
        placeholder if weight.lut is None else weight.lut,
        placeholder if weight.perm is None else weight.perm,
        placeholder if bias is None else bias,
        out,
        m, n, k,
        x.stride(0), x.stride(1), weight.qweight.stride(0), weight.scales.stride(0),
        stride_os, out.stride(-2),
        tiles_per_split,
        BITS=weight.bits,
        GROUP_SIZE=weight.group_size,
        ONE_GROUP=weight.group_size % cfg.block_k == 0,
        HAS_MINS=weight.mins is not None,
        HAS_LUT=weight.lut is not None,
        HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None,
        UPCAST_DOT=upcast,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else None,  # not tf32
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=stages,
    )  # fmt: skip

"""GPTQ checkpoints (AutoGPTQ, gptqmodel, transformers) -> llmserve's ``QuantizedWeight``.

A GPTQ linear layer ``[N = out_features, K = in_features]`` is stored as

    qweight  int32 [K * bits / 32, N]   codes packed along K
    qzeros   int32 [num_groups, N * bits / 32]   zero points packed along N
    scales   fp16  [num_groups, N]
    g_idx    int32 [K]                  group of each input column (act-order: not k // G)

    W[n, k] = scales[g, n] * (q[k, n] - zero[g, n])      g = g_idx[k]

Packing: the int32 words along the packed dimension form one little-endian bit stream and
value i occupies bits [i * bits, (i + 1) * bits). For 2/4/8 bits that is "value i at bits
(i % (32 / bits)) * bits of word i // (32 / bits)"; for 3 bits, 32 values span 3 words:

    word 0: v0..v9 (3 bits each), low 2 bits of v10 | word 1: high bit of v10, v11..v20,
    low bit of v21 | word 2: high 2 bits of v21, v22..v31

checkpoint_format "gptq" (v1) stores zero - 1 in each slot (the zero is stored + 1, per slot,
as AutoGPTQ's kernels read it); "gptq_v2" stores the zero itself.

Internal layout: bits 2/3/4 -> 4-bit codes 0..2^bits-1 with mins = -scale * zero; bits 8 ->
int8 value = q - 128 with mins = scale * (128 - zero) (None when sym and every zero is 128).
Act-order columns are stored sorted by group, with ``perm`` = stable argsort of g_idx.
"""

from __future__ import annotations

import math
import sys

import torch

from llmserve.quantization.layout import BLOCK, QuantizedWeight, pack_int4

INT8_OFFSET = 128  # 8-bit codes 0..255 -> int8 values -128..127


def gptq_to_internal(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
    checkpoint_format: str,
    layer_name: str,
) -> QuantizedWeight:
    """One GPTQ linear layer's tensors -> a ``QuantizedWeight`` (shapes in the module doc).

    ``g_idx`` decides the grouping (None: column k in group k // G); ``desc_act`` only makes a
    missing g_idx an error. Raises ValueError naming ``layer_name`` for inconsistent tensors.
    """
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"{layer_name}: GPTQ bits={bits} is not supported; allowed: 2, 3, 4, 8")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"{layer_name}: GPTQ checkpoint_format={checkpoint_format!r} is not supported; "
            "allowed: 'gptq', 'gptq_v2'"
        )
    if desc_act and g_idx is None:
        raise ValueError(f"{layer_name}: act-order (desc_act) checkpoint without a g_idx tensor")
    k, n, g = _check_gptq_shapes(qweight, qzeros, scales, g_idx, bits, group_size, layer_name)
    codes = unpack_int32_stream(qweight, bits, k)  # [K, N] uint8, original column order
    zeros = unpack_int32_stream(qzeros.T, bits, n).float()  # [N, num_groups]
    if checkpoint_format == "gptq":
        zeros += 1
    perm = act_order_perm(g_idx, k, g, layer_name)
    if perm is not None:
        codes = codes[perm]  # [K, N] input columns sorted by group
    codes = codes.T.contiguous()  # [N, K]
    return from_codes(codes, zeros, scales.T, bits=bits, group_size=g, perm=perm, sym=sym)


def from_codes(
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
    sym: bool = False,
) -> QuantizedWeight:
    """Unsigned codes ``[N, K]`` (0..2^bits-1), zeros and scales float ``[N, K / G]`` with
    ``W = scale * (code - zero)`` -> a ``QuantizedWeight`` (4-bit for bits <= 4, else 8-bit)."""
    scales = scales.to(torch.float32).contiguous()  # [N, K/G]
    if bits <= 4:
        qweight = pack_int4(codes)  # [N, K/2] uint8
        mins = -scales * zeros
        return QuantizedWeight(4, qweight, scales, mins.contiguous(), group_size, perm=perm)
    values = (codes.to(torch.int16) - INT8_OFFSET).to(torch.int8)  # [N, K] int8
    mins = None
    if not (sym and bool((zeros == INT8_OFFSET).all())):
        mins = (scales * (INT8_OFFSET - zeros)).contiguous()
    return QuantizedWeight(8, values.contiguous(), scales, mins, group_size, perm=perm)


def unpack_int32_stream(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 ``[num_words, C]`` packed along dim 0 -> uint8 ``[count, C]``.

    Value i is bits [i * bits, (i + 1) * bits) of the little-endian stream of each column's
    words (GPTQ's layout for 2, 3, 4 and 8 bits; AWQ's nibble order before its interleave).
    """
    if bits in (4, 8) and sys.byteorder == "little":
        return _unpack_whole_bytes(words, bits, count)
    common = math.gcd(bits, 32)
    cycle_words, cycle_values = bits // common, 32 // common  # 3 bits: 3 words, 32 values
    num_words, num_cols = words.shape
    cycles = words.to(torch.int32).reshape(num_words // cycle_words, cycle_words, num_cols)
    out = torch.empty(cycles.shape[0], cycle_values, num_cols, dtype=torch.uint8)
    mask = (1 << bits) - 1
    for j in range(cycle_values):
        word, shift = divmod(j * bits, 32)
        low_bits = min(bits, 32 - shift)
        value = (cycles[:, word] >> shift) & ((1 << low_bits) - 1)  # [cycles, C]
        if low_bits < bits:
            value |= (cycles[:, word + 1] << low_bits) & mask
        out[:, j] = value
    return out.reshape(-1, num_cols)[:count]


def _unpack_whole_bytes(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The 4/8-bit case of ``unpack_int32_stream`` on bytes: byte b of a little-endian word
    holds value b (8 bits) or values 2b (low nibble) and 2b + 1 (high nibble)."""
    num_words, num_cols = words.shape
    data = words.to(torch.int32).contiguous().reshape(-1).view(torch.uint8)  # [W * C * 4]
    data = data.reshape(num_words, num_cols, 4)  # [W, C, bytes]
    if bits == 4:
        data = torch.stack([data & 0x0F, data >> 4], dim=-1).reshape(num_words, num_cols, 8)
    return data.transpose(1, 2).reshape(-1, num_cols)[:count]  # [W * values, C]


def act_order_perm(
    g_idx: torch.Tensor | None, k: int, group_size: int, layer_name: str
) -> torch.Tensor | None:
    """None when ``g_idx`` is k // G; else the stable argsort of g_idx (int64 ``[K]``), which
    makes every group a contiguous run of exactly ``group_size`` stored columns."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    expected = torch.arange(k) // group_size  # [K] group of each sorted column
    if torch.equal(g_idx, expected):
        return None
    perm = torch.argsort(g_idx, stable=True)  # [K]
    if not torch.equal(g_idx[perm], expected):
        sizes = torch.bincount(g_idx.clamp(min=0))
        raise ValueError(
            f"{layer_name}: g_idx does not split the {k} input columns into {k // group_size} "
            f"groups of exactly {group_size} (group ids {int(g_idx.min())}..{int(g_idx.max())}, "
            f"group sizes {int(sizes.min())}..{int(sizes.max())}); llmserve needs equal groups"
        )
    return perm


def _check_gptq_shapes(qweight, qzeros, scales, g_idx, bits, group_size, layer_name):
    """(K, N, G) of a GPTQ layer, or a ValueError naming the layer and the mismatch."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(
            f"{layer_name}: qweight must be a 2-D int32 tensor, got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    if (qweight.shape[0] * 32) % bits:
        raise ValueError(f"{layer_name}: qweight rows {qweight.shape[0]} do not fit {bits} bits")
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    g = effective_group_size(k, group_size, layer_name)
    num_groups = k // g
    if tuple(scales.shape) != (num_groups, n):
        raise ValueError(
            f"{layer_name}: scales shape {tuple(scales.shape)} does not match "
            f"[num_groups={num_groups}, out_features={n}] from qweight {tuple(qweight.shape)}"
        )
    if (n * bits) % 32 or tuple(qzeros.shape) != (num_groups, n * bits // 32):
        raise ValueError(
            f"{layer_name}: qzeros shape {tuple(qzeros.shape)} does not match "
            f"[{num_groups}, {n} * {bits} / 32] for out_features={n}"
        )
    if g_idx is not None and tuple(g_idx.shape) != (k,):
        raise ValueError(
            f"{layer_name}: g_idx shape {tuple(g_idx.shape)} does not match in_features={k}"
        )
    return k, n, g


def effective_group_size(k: int, group_size: int, layer_name: str) -> int:
    """``group_size`` with -1 meaning all K columns, checked against the internal layout."""
    if k % BLOCK:
        raise ValueError(f"{layer_name}: in_features {k} is not a multiple of {BLOCK}")
    g = k if group_size == -1 else group_size
    if g <= 0 or g % BLOCK or k % g:
        raise ValueError(
            f"{layer_name}: group_size={group_size} does not divide in_features {k} into "
            f"groups of a multiple of {BLOCK} columns (allowed: -1 or a multiple of {BLOCK} "
            f"that divides {k})"
        )
    return g

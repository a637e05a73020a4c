"""AWQ checkpoints (AutoAWQ's GEMM layout, as transformers loads them) -> ``QuantizedWeight``.

A linear layer ``[N = out_features, K = in_features]`` is stored packed along the OUTPUT dim:

    qweight  int32 [K, N / 8]            8 nibbles per word
    qzeros   int32 [K / G, N / 8]        same packing
    scales   fp16  [K / G, N]

    W[n, k] = scales[k // G, n] * (q[k, n] - zero[k // G, n])          (no +1, unlike GPTQ v1)

Nibble i (bits 4i..4i+3) of word c holds output column 8c + AWQ_ORDER[i]:

    nibble:  0  1  2  3  4  5  6  7
    column:  0  2  4  6  1  3  5  7

Internal layout: 4-bit codes 0..15, mins = -scale * zero, no perm.
"""

from __future__ import annotations

import torch

from llmserve.quantization.gptq import effective_group_size, from_codes, unpack_int32_stream
from llmserve.quantization.layout import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) held by nibble i
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble holding output column c
PACK = 8  # 4-bit values per int32


def awq_to_internal(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    layer_name: str,
) -> QuantizedWeight:
    """One AWQ GEMM linear layer's tensors -> a ``QuantizedWeight`` (shapes in the module doc).

    Raises ValueError naming ``layer_name`` for a bit width other than 4 or inconsistent shapes.
    """
    if bits != 4:
        raise ValueError(f"{layer_name}: AWQ bits={bits} is not supported; allowed: 4")
    k, n, g = _check_awq_shapes(qweight, qzeros, scales, group_size, layer_name)
    codes = unpack_awq(qweight)  # [N, K] uint8
    zeros = unpack_awq(qzeros).float()  # [N, K/G]
    return from_codes(codes, zeros, scales.T, bits=4, group_size=g)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, N / 8]`` in AWQ's interleaved order -> uint8 ``[N, R]`` (output-major)."""
    rows, words = packed.shape
    nibbles = unpack_int32_stream(packed.T, 4, words * PACK)  # [N, R] in nibble order
    reverse = torch.tensor(AWQ_REVERSE_ORDER)
    return nibbles.reshape(words, PACK, rows)[:, reverse].reshape(words * PACK, rows)


def _check_awq_shapes(qweight, qzeros, scales, group_size, layer_name):
    """(K, N, G) of an AWQ layer, or a ValueError naming the layer and the mismatch."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(
            f"{layer_name}: qweight must be a 2-D int32 tensor, got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    g = effective_group_size(k, group_size, layer_name)
    if tuple(scales.shape) != (k // g, n):
        raise ValueError(
            f"{layer_name}: scales shape {tuple(scales.shape)} does not match "
            f"[num_groups={k // g}, out_features={n}] from qweight {tuple(qweight.shape)}"
        )
    if tuple(qzeros.shape) != (k // g, n // PACK):
        raise ValueError(
            f"{layer_name}: qzeros shape {tuple(qzeros.shape)} does not match "
            f"[{k // g}, {n // PACK}] for out_features={n}"
        )
    return k, n, g

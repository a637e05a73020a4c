"""``--quantization gguf``: a GGUF file's quantized blocks, converted to the internal layout.

The values and scales are carried over exactly (no requantization), as llama.cpp computes on
them; only the byte order changes. Per row of the weight, per GGUF block:

    Q4_0  [d f16][16 B nibbles]            w = d * (q - 8)          -> 4-bit, G 32, min -8d
    Q4_1  [d f16][m f16][16 B nibbles]     w = d * q + m            -> 4-bit, G 32
    Q8_0  [d f16][32 x int8]               w = d * q                -> 8-bit, G 32
    Q4_K  256 values: d, dmin f16, 8 x 6-bit (scale, min), nibbles   -> 4-bit, G 32
          w = d * sc_j * q - dmin * m_j for sub-block j of 32
    Q5_K  as Q4_K plus a fifth bit per value in qh                  -> 8-bit (0..31), G 32
    Q6_K  256 values: 4 low bits (ql), 2 high bits (qh), 16 int8 scales, d f16
          w = d * sc_j * (q - 32) for sub-block j of 16             -> 8-bit, G 16

F32, F16 and BF16 tensors stay floating point; any other type is refused with the list above.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from llmserve.quantization.layout import QuantizedWeight, pack_int4

QT = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


def is_supported(qtype: int) -> bool:
    return QT(qtype) in SUPPORTED_TYPES


def unsupported_type_message(name: str, qtype: int) -> str:
    supported = ", ".join(t.name for t in SUPPORTED_TYPES + FLOAT_TYPES)
    return (
        f"GGUF tensor {name!r} has type {QT(qtype).name}, which --quantization gguf cannot "
        f"compute on (supported: {supported}); omit --quantization gguf to dequantize the "
        "file to floating point at load instead"
    )


def _f16(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 -> float32 ``[...]`` from little-endian fp16 bytes."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    """Raw tensor bytes -> ``[rows, blocks_per_row, block_bytes]``."""
    return np.asarray(data, dtype=np.uint8).reshape(rows, -1, block_bytes)


def _weight(bits, values_or_packed, scales, mins, group_size) -> QuantizedWeight:
    as_tensor = torch.from_numpy
    return QuantizedWeight(
        bits=bits,
        qweight=as_tensor(np.ascontiguousarray(values_or_packed)),
        scales=as_tensor(np.ascontiguousarray(scales, dtype=np.float32)),
        mins=None if mins is None else as_tensor(np.ascontiguousarray(mins, dtype=np.float32)),
        group_size=group_size,
    )


def _q4_0(b: np.ndarray) -> QuantizedWeight:
    rows = b.shape[0]
    d = _f16(b[..., 0:2])  # [rows, nb]
    packed = b[..., 2:18].reshape(rows, -1)  # already our nibble order
    return _weight(4, packed, d, -8.0 * d, 32)


def _q4_1(b: np.ndarray) -> QuantizedWeight:
    rows = b.shape[0]
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return _weight(4, b[..., 4:20].reshape(rows, -1), d, m, 32)


def _q8_0(b: np.ndarray) -> QuantizedWeight:
    rows = b.shape[0]
    d = _f16(b[..., 0:2])
    values = b[..., 2:34].view(np.int8).reshape(rows, -1)
    return _weight(8, values, d, None, 32)


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, ``[..., 8]`` each."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), dtype=np.float32)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes per super-block -> 256 low 4-bit values in order.

    Chunk c of 32 bytes holds values 64c + l (low nibble) and 64c + 32 + l (high nibble)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)  # [..., 4, 1, 32]
    return np.concatenate([chunks & 0xF, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _q4_k(b: np.ndarray) -> QuantizedWeight:
    rows = b.shape[0]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [rows, nb]
    sc, mn = _k_scales_mins(b[..., 4:16])  # [rows, nb, 8]
    codes = _k_low_nibbles(b[..., 16:144]).reshape(rows, -1)  # [rows, K]
    scales = (d[..., None] * sc).reshape(rows, -1)
    mins = (-dmin[..., None] * mn).reshape(rows, -1)
    return _weight(4, pack_int4(torch.from_numpy(codes)).numpy(), scales, mins, 32)


def _q5_k(b: np.ndarray) -> QuantizedWeight:
    rows = b.shape[0]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales_mins(b[..., 4:16])
    qh = b[..., 16:48]  # [rows, nb, 32]: bit 2c (+1) is the fifth bit of chunk c's low (high) half
    low = _k_low_nibbles(b[..., 48:176])  # [rows, nb, 256]
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = (qh[..., None, :] >> shifts) & 1  # [rows, nb, 8, 32]: half-chunk h = 2c + (0|1)
    values = (low + (high.reshape(*low.shape) << 4)).astype(np.int8)
    scales = (d[..., None] * sc).reshape(rows, -1)
    mins = (-dmin[..., None] * mn).reshape(rows, -1)
    return _weight(8, values.reshape(rows, -1), scales, mins, 32)


def _q6_k(b: np.ndarray) -> QuantizedWeight:
    rows, nb = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, nb, 2, 2, 32)  # [.., half n, ql[l] | ql[l+32], l]
    qh = b[..., 128:192].reshape(rows, nb, 2, 1, 32)  # [.., half n, 1, l]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [rows, nb, 16]
    d = _f16(b[..., 208:210])  # [rows, nb]
    low = np.stack([ql & 0xF, ql >> 4], axis=3)  # [.., n, nibble, which, l]: +32*which +64*nibble
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 2, 2, 1)  # [nibble, which]
    high = (qh[:, :, :, None] >> shifts) & 3  # [rows, nb, n, nibble, which, l]
    values = (low | (high << 4)).astype(np.int16) - 32  # order n, nibble, which, l = 128n+64i+32w+l
    values = values.astype(np.int8).reshape(rows, -1)
    scales = (d[..., None] * sc).reshape(rows, -1)
    return _weight(8, values, scales, None, 16)


_CONVERTERS = {QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q8_0: _q8_0, QT.Q4_K: _q4_k, QT.Q5_K: _q5_k}
_CONVERTERS[QT.Q6_K] = _q6_k


def gguf_to_internal(name: str, qtype: int, data: np.ndarray, shape: tuple[int, int]):
    """One GGUF tensor's raw blocks -> ``QuantizedWeight`` of HF shape ``[out, in]``."""
    qtype = QT(qtype)
    if qtype not in _CONVERTERS:
        raise ValueError(unsupported_type_message(name, qtype))
    rows, cols = shape
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_values:
        raise ValueError(
            f"GGUF tensor {name!r}: {cols} columns is not a multiple of {block_values}"
        )
    return _CONVERTERS[qtype](_blocks(data, rows, block_bytes))

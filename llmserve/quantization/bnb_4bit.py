"""bitsandbytes' 4-bit formats: NF4 and FP4, with optional double quant (QLoRA).

bitsandbytes treats a weight ``[N, K]`` as one flat vector cut into blocks of ``blocksize``
(64) values, keeps the fp32 absmax of each block, and stores each value as the 4-bit index of
the nearest code-book entry to ``w / absmax`` (code books below), two per byte:

    flat  = W.reshape(-1)                                      element i = W[i // K, i % K]
    byte j = code[2j] << 4 | code[2j + 1]                      first element in the high nibble
    W_flat[i] = CODE[code[i]] * absmax[i // blocksize]

Double quant (``compress_statistics``) stores the absmax vector itself in 8 bits: its mean is
taken out (``offset``) and the rest quantized in blocks of 256 with the signed dynamic 8-bit
code map (``dynamic_code_map``), keeping one fp32 absmax per 256-block:

    absmax[b] = DYNAMIC[qabsmax[b]] * nested_absmax[b // 256] + offset

Every code here is the nearest code-book entry, picked as bitsandbytes' reference (pure torch)
kernel does; its 4-bit CPU path is that kernel. (bitsandbytes >= 0.50 quantizes the nested
8-bit statistics on CPU through a 65536-bin lookup table instead, which can pick a slightly
farther dynamic-map entry for values near zero; its CUDA kernel searches exactly.)

``to_internal`` converts to llmserve's layout (``layout.py``): when ``K % blocksize == 0``
each block lies in one row (block ``b`` is group ``b % (K / G)`` of row ``b // (K / G)``,
``G = blocksize``); the 16 code values become the int8 ``lut = round(CODE * 127)`` and
``scales = absmax / 127``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.quantization.layout import BLOCK, QuantizedWeight, pack_int4

QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256

# NormalFloat4 (QLoRA): quantiles of N(0, 1) scaled to [-1, 1], in code order.
_NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# bitsandbytes' FP4 (1 sign, 2 exponent, 1 mantissa bits, exponent bias 2) in code order,
# divided by its largest magnitude 12; codes 8..15 are the negatives of codes 0..7.
_FP4_UNSCALED = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)


def code_book(quant_type: str) -> torch.Tensor:
    """The value of each 4-bit code, float32 ``[16]`` (bitsandbytes' ``get_4bit_type``)."""
    if quant_type == "nf4":
        return torch.tensor(_NF4, dtype=torch.float32)
    if quant_type == "fp4":
        half = torch.tensor(_FP4_UNSCALED, dtype=torch.float32)
        return torch.cat([half, -half]) / 12.0
    raise ValueError(f"quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")


def dynamic_code_map() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (``create_dynamic_map``), float32 ``[256]`` sorted."""
    values = [0.0, 1.0]
    for i in range(7):  # magnitude 10^(i-6) times 2^i fractions in (0.1, 1)
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        values += ((10 ** (i - 6)) * means).tolist()
        values += (-(10 ** (i - 6)) * means).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


@dataclass(frozen=True)
class Bnb4bitWeight:
    """A weight as bitsandbytes stores it after ``quantize_4bit`` (its ``QuantState`` fields)."""

    packed: torch.Tensor
    """uint8 ``[N * K // 2, 1]``: two codes per byte, the first element in the high nibble."""
    absmax: torch.Tensor
    """float32 ``[num_blocks]``; with double quant uint8 ``[num_blocks]`` (dynamic-map codes)."""
    shape: tuple[int, int]
    """``(out_features, in_features)``."""
    quant_type: str
    """``"nf4"`` or ``"fp4"``."""
    blocksize: int = 64
    """Flattened values sharing one absmax."""
    nested_absmax: torch.Tensor | None = None
    """Double quant: float32 ``[ceil(num_blocks / 256)]``, the absmax of each 256-block."""
    offset: torch.Tensor | None = None
    """Double quant: float32 scalar, the mean of the absmax vector (added back)."""

    @property
    def is_nested(self) -> bool:
        return self.nested_absmax is not None

    def block_absmax(self) -> torch.Tensor:
        """float32 ``[num_blocks]``: the stored absmax, dequantized first under double quant."""
        if not self.is_nested:
            return self.absmax
        code = dynamic_code_map().to(self.absmax.device)
        values = code[self.absmax.long()]  # [num_blocks]
        num_blocks = values.numel()
        scales = self.nested_absmax.repeat_interleave(NESTED_BLOCKSIZE)[:num_blocks]
        return values * scales + self.offset

    def codes(self) -> torch.Tensor:
        """uint8 ``[N * K]``: the 4-bit code of every flattened element."""
        flat = self.packed.reshape(-1)
        codes = torch.stack([flat >> 4, flat & 0x0F], dim=1)  # [N * K / 2, 2]
        return codes.reshape(-1)[: self.shape[0] * self.shape[1]]


def quantize_4bit(
    weight: torch.Tensor,
    quant_type: str = "nf4",
    blocksize: int = 64,
    compress_statistics: bool = False,
) -> Bnb4bitWeight:
    """Float ``[N, K]`` -> bitsandbytes' NF4/FP4 storage (its ``quantize_4bit``, code for code)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"expected a float weight [out, in], got {weight.dtype} {tuple(weight.shape)}"
        )
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    if weight.numel() % 2:
        raise ValueError(f"4-bit packing needs an even number of values, got {tuple(weight.shape)}")
    flat = weight.detach().reshape(-1).float()  # [N * K]
    codes, absmax = _quantize_blocks(flat, code_book(quant_type).to(flat.device), blocksize)
    packed = (codes[0::2] << 4) | codes[1::2]  # [N * K / 2]
    shape = (weight.shape[0], weight.shape[1])
    if not compress_statistics:
        return Bnb4bitWeight(packed.unsqueeze(1), absmax, shape, quant_type, blocksize)
    offset = absmax.mean()
    code = dynamic_code_map().to(flat.device)
    qabsmax, nested_absmax = _quantize_blocks(absmax - offset, code, NESTED_BLOCKSIZE)
    return Bnb4bitWeight(
        packed.unsqueeze(1), qabsmax, shape, quant_type, blocksize, nested_absmax, offset
    )


def _quantize_blocks(
    flat: torch.Tensor, code: torch.Tensor, blocksize: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[n]`` -> (uint8 codes ``[n]``, float32 absmax ``[ceil(n / blocksize)]``).

    As bitsandbytes' reference kernel: scale by the reciprocal of the block absmax, clamp to
    [-1, 1], and bucket by the midpoints of the sorted code book (a tie goes to the lower).
    """
    n = flat.numel()
    blocks = _pad_to_blocks(flat, blocksize)  # [num_blocks, blocksize]
    absmax = blocks.abs().amax(dim=1)  # [num_blocks]
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1), -1, 1)
    order = torch.argsort(code, stable=True)  # FP4: code 0 (+0) sorts before code 8 (-0)
    midpoints = (code[order[:-1]] + code[order[1:]]) / 2
    index = torch.bucketize(scaled.reshape(-1)[:n], midpoints)  # [n] position in sorted order
    return order[index].to(torch.uint8), absmax


def _pad_to_blocks(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``[n]`` -> ``[ceil(n / blocksize), blocksize]``, the last block padded with zeros."""
    pad = -flat.numel() % blocksize
    return torch.nn.functional.pad(flat, (0, pad)).reshape(-1, blocksize)


def dequantize_4bit(weight: Bnb4bitWeight) -> torch.Tensor:
    """float32 ``[N, K]`` with the exact code-book values, as bitsandbytes' ``dequantize_4bit``."""
    n, k = weight.shape
    values = code_book(weight.quant_type).to(weight.packed.device)[weight.codes().long()]
    blocks = _pad_to_blocks(values, weight.blocksize)  # [num_blocks, blocksize]
    out = blocks * weight.block_absmax().unsqueeze(1)
    return out.reshape(-1)[: n * k].reshape(n, k)


def to_internal(weight: Bnb4bitWeight) -> QuantizedWeight:
    """llmserve's layout: group = blocksize, ``lut = round(CODE * 127)``, ``scale = absmax / 127``."""
    n, k = weight.shape
    if k % weight.blocksize or weight.blocksize % BLOCK:
        raise ValueError(
            f"{weight.quant_type} needs in_features divisible by the block size "
            f"{weight.blocksize} (and a block size that is a multiple of {BLOCK}); "
            f"got in_features {k}"
        )
    codes = weight.codes().reshape(n, k)  # [N, K]
    lut = torch.round(code_book(weight.quant_type) * 127).to(torch.int8)
    scales = (weight.block_absmax() / 127.0).reshape(n, k // weight.blocksize)  # [N, K / G]
    return QuantizedWeight(
        bits=4,
        qweight=pack_int4(codes),
        scales=scales.float().contiguous(),
        mins=None,
        group_size=weight.blocksize,
        lut=lut.to(codes.device),
    )

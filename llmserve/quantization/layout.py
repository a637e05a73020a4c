"""llmserve's one internal layout for quantized linear weights, and its plain-torch reference.

Every method (int8, LLM.int8, NF4/FP4, GGUF blocks, GPTQ, AWQ) is converted at load into a
``QuantizedWeight``: integer values per weight, a float scale per group of ``group_size``
input columns, and optionally a float min (zero point) per group:

    W[n, k] = scales[n, k // G] * value(n, k) + mins[n, k // G]        (mins None: + 0)

    bits = 8: value = qweight[n, k]                      qweight int8  [N, K]
    bits = 4: code  = nibble of qweight (below)          qweight uint8 [N, K // 2]
              value = lut[code] if lut is not None else code   (lut int8 [16])

4-bit packing, per row, per block of 32 columns (the same order as GGUF's Q4_0/Q4_1 blocks,
so a SIMD kernel gets columns 0..15 from the low nibbles of 16 bytes, 16..31 from the high):

    block b = columns 32b .. 32b+31  ->  bytes 16b .. 16b+15
    byte 16b + j = code[32b + j] | code[32b + j + 16] << 4          (j = 0..15)

Act-order checkpoints (GPTQ desc_act) are stored with their columns sorted by group, so groups
are contiguous; ``perm`` says which input feature each stored column reads:

    y = x[:, perm] @ W_stored^T        (perm None: y = x @ W_stored^T)

Constraints: K (in_features) a multiple of 32; G a multiple of 32, or 16 (GGUF Q6_K) for
8-bit weights; K a multiple of G.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

BLOCK = 32  # columns per packing block (and per activation block in the CPU kernels)


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight ``[out_features, in_features]`` in llmserve's internal layout."""

    bits: int
    """4 or 8."""
    qweight: torch.Tensor
    """bits 8: int8 ``[N, K]``; bits 4: uint8 ``[N, K // 2]`` (packing in the module doc)."""
    scales: torch.Tensor
    """float32 ``[N, K // group_size]``."""
    mins: torch.Tensor | None
    """float32 ``[N, K // group_size]`` added after scaling, or None."""
    group_size: int
    """Input columns sharing one scale (and min)."""
    lut: torch.Tensor | None = None
    """bits 4 only: int8 ``[16]``, the value of each 4-bit code (NF4/FP4); None: value = code."""
    perm: torch.Tensor | None = None
    """int64 ``[K]``: stored column i multiplies input feature perm[i] (act-order), or None."""

    def __post_init__(self) -> None:
        n, k = self.shape
        assert self.bits in (4, 8), self.bits
        assert k % BLOCK == 0, f"in_features {k} is not a multiple of {BLOCK}"
        assert self.group_size in (16, *range(BLOCK, k + 1, BLOCK)) and k % self.group_size == 0
        assert self.group_size >= BLOCK or self.bits == 8
        assert self.scales.shape == (n, k // self.group_size), (self.scales.shape, n, k)
        assert self.mins is None or self.mins.shape == self.scales.shape
        assert self.lut is None or (self.bits == 4 and self.lut.shape == (16,))
        assert self.perm is None or self.perm.shape == (k,)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        rows, cols = self.qweight.shape
        return rows, cols * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        """Resident bytes of every tensor held."""
        tensors = (self.qweight, self.scales, self.mins, self.lut, self.perm)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def values(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The integer value of every weight (of ``rows`` only, if given) as float32 ``[N, K]``
        (before scale and min)."""
        qweight = self.qweight if rows is None else self.qweight.index_select(0, rows)
        if self.bits == 8:
            return qweight.float()
        codes = unpack_int4(qweight)  # [N, K] uint8 0..15
        if self.lut is not None:
            return self.lut.to(torch.float32)[codes.long()]
        return codes.float()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[N, K]`` in the stored column order (reference for every kernel); with
        ``rows`` (int64) only those rows, e.g. the token-table rows of an embedding lookup."""

        def per_column(t: torch.Tensor) -> torch.Tensor:  # [N, K / G] -> [N, K]
            t = t if rows is None else t.index_select(0, rows)
            return t.repeat_interleave(self.group_size, dim=1)

        w = self.values(rows) * per_column(self.scales)
        return w if self.mins is None else w + per_column(self.mins)

    def dequantize_original_order(self) -> torch.Tensor:
        """float32 ``[N, K]`` with column k multiplying input feature k (``perm`` undone)."""
        w = self.dequantize()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The same weight with output rows reordered/selected by ``index`` (int64)."""
        mins = None if self.mins is None else self.mins.index_select(0, index)
        return replace(
            self,
            qweight=self.qweight.index_select(0, index),
            scales=self.scales.index_select(0, index),
            mins=mins,
        )

    def select_cols(self, start: int, end: int) -> QuantizedWeight:
        """Input columns ``start..end`` (a tensor-parallel rank's share of a row-parallel
        layer); both must fall on group and packing-block boundaries, and act-order weights,
        whose stored columns are permuted, cannot be cut."""
        step = max(self.group_size, BLOCK)
        if self.perm is not None:
            raise ValueError("act-order (desc_act) weights cannot be split by input column")
        if start % step or end % step:
            raise ValueError(
                f"input columns {start}..{end} do not fall on the {step}-column groups"
            )
        per_byte = 2 if self.bits == 4 else 1
        groups = slice(start // self.group_size, end // self.group_size)
        return replace(
            self,
            qweight=self.qweight[:, start // per_byte : end // per_byte].contiguous(),
            scales=self.scales[:, groups].contiguous(),
            mins=None if self.mins is None else self.mins[:, groups].contiguous(),
        )

    def pad_rows(self, rows: int) -> QuantizedWeight:
        """``rows`` more output rows that dequantize to zero (a padded vocabulary shard)."""

        def pad(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.nn.functional.pad(t, (0, 0, 0, rows))

        return replace(
            self, qweight=pad(self.qweight), scales=pad(self.scales), mins=pad(self.mins)
        )

    def to(self, device: torch.device) -> QuantizedWeight:
        def move(t):
            return None if t is None else t.to(device)

        return replace(
            self,
            qweight=move(self.qweight),
            scales=move(self.scales),
            mins=move(self.mins),
            lut=move(self.lut),
            perm=move(self.perm),
        )


def can_concat(parts: list[QuantizedWeight]) -> bool:
    """Whether weights stacked along the output dimension fit one ``QuantizedWeight``."""
    first = parts[0]
    for part in parts[1:]:
        if (part.bits, part.group_size, part.shape[1]) != (
            first.bits,
            first.group_size,
            first.shape[1],
        ):
            return False
        if (part.mins is None) != (first.mins is None):
            return False
        for a, b in ((part.lut, first.lut), (part.perm, first.perm)):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                return False
    return True


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack compatible weights along the output dimension (fused q/k/v, gate/up)."""
    assert can_concat(parts)
    first = parts[0]
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    return replace(
        first,
        qweight=torch.cat([p.qweight for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        mins=mins,
    )


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integer codes 0..15 -> uint8 ``[N, K // 2]`` in the layout above."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)  # [N, K/32, 2, 16]
    packed = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # [N, K/32, 16]
    return packed.reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K // 2]`` -> codes uint8 ``[N, K]`` (inverse of ``pack_int4``)."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // (BLOCK // 2), 1, BLOCK // 2)  # [N, K/32, 1, 16]
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=2)  # [N, K/32, 2, 16]
    return codes.reshape(n, half * 2)


def reference_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., N]`` by dequantize-then-fp32-matmul: the accuracy reference."""
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    out = x.float() @ weight.dequantize().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

"""A GGUF file's metadata and tensor table, parsed straight from its header.

gguf-py's ``GGUFReader`` builds numpy views for every element of every metadata array: half a
minute over a 262k-token vocabulary (Gemma 3), seconds over SmolLM2's 49k. This parser reads
the same header in well under a second and exposes the part of the reader's interface the
loader uses: ``fields[key].contents()`` and ``tensors`` (``name``, ``tensor_type``, ``shape``
innermost dimension first, ``data`` as a read-only memory-mapped numpy array: typed for the
float and integer types, bytes ``[..., row bytes]`` for block-quantized ones).

    header    "GGUF", version (2 or 3), tensor count, key-value count       (little-endian)
    metadata  key (u64 length + UTF-8), value type (u32), value; arrays: item type, count, items
    tensors   name, dimension count, dimensions, type, offset from the aligned data start
    data      at the next multiple of ``general.alignment`` (32 if absent)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

# metadata value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_STRING, _ARRAY = 8, 9
_T = gguf.GGMLQuantizationType
_PLAIN_DTYPES = {
    _T.F16: np.float16,
    _T.F32: np.float32,
    _T.F64: np.float64,
    _T.I8: np.int8,
    _T.I16: np.int16,
    _T.I32: np.int32,
    _T.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFField:
    """One metadata value (already decoded: str, int, float, bool or a list of them)."""

    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray
    """Dimensions innermost first, as GGUF (and ``GGUFReader``) lists them."""
    data: np.ndarray


class GGUFFile:
    """The parsed header of ``path`` (``fields``, ``tensors``); tensor data memory-mapped."""

    def __init__(self, path: str):
        self._data = np.memmap(path, dtype=np.uint8, mode="r")
        self._offset = 0
        magic, version, num_tensors, num_kv = self._take("<4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
        self.fields = {}
        for _ in range(num_kv):
            key = self._string()
            self.fields[key] = GGUFField(self._value(self._take("<I")[0]))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", GGUFField(32)).value)
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._data, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._take("<Q")
        start = self._offset
        self._offset += length
        return bytes(self._data[start : self._offset]).decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            return self._take("<" + _SCALARS[kind])[0]
        item, count = self._take("<IQ")
        if item == _STRING:
            return [self._string() for _ in range(count)]
        if item == _ARRAY:
            return [self._value(_ARRAY) for _ in range(count)]
        dtype = np.dtype("<" + _SCALARS[item])
        values = np.frombuffer(self._data, dtype, count, self._offset).tolist()
        self._offset += count * dtype.itemsize
        return values

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        (num_dims,) = self._take("<I")
        dims = list(self._take(f"<{num_dims}Q"))
        kind, offset = self._take("<IQ")
        return name, dims, kind, offset

    def _tensor(self, start: int, name: str, dims: list[int], kind: int, offset: int):
        qtype = gguf.GGMLQuantizationType(kind)
        shape = list(reversed(dims))  # outermost first, as numpy
        num_elements = int(np.prod(dims))
        dtype = _PLAIN_DTYPES.get(qtype)
        if dtype is None:  # blocks: bytes per row
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            shape[-1] = shape[-1] // block_size * type_size
            dtype, count = np.uint8, num_elements // block_size * type_size
        else:
            count = num_elements
        data = np.frombuffer(self._data, dtype, count, start + offset).reshape(shape)
        return GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), data)

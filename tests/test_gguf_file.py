"""llmserve's GGUF header parser (``loader/gguf_file.py``) against gguf-py's ``GGUFReader``:
the same metadata values and the same tensors (type, shape, bytes) for every value type and
for float, integer and block-quantized tensors, and for the default model's file."""

from __future__ import annotations

import os

# as in test_model_families.py: set before llmserve imports triton, whichever file runs first
os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from llmserve.loader.default_model import default_model_path
from llmserve.loader.gguf_file import GGUFFile


def assert_same_file(path: str) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        expected = theirs.fields[key].contents()
        if _is_float(expected):
            expected = pytest.approx(expected)
        assert field.contents() == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        np.testing.assert_array_equal(a.data, b.data)


def _is_float(value) -> bool:
    return isinstance(value, float) or (isinstance(value, list) and value and _is_float(value[0]))


def test_every_value_and_tensor_type(tmp_path):
    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_uint32("t.u32", 70000)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float32("t.f32", 0.25)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ 日本")
    writer.add_array("t.strs", ["a", "", "  ", "<0x0A>"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.5])
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("f32", matrix)
    writer.add_tensor("f16", matrix.astype(np.float16))
    writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    writer.add_tensor("vector", matrix[0])
    for qtype in (QType.Q4_0, QType.Q8_0, QType.BF16):
        writer.add_tensor(qtype.name, gguf.quants.quantize(matrix, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_file(path)
    assert GGUFFile(path).fields["t.strs"].contents() == ["a", "", "  ", "<0x0A>"]


def test_default_model_file():
    assert_same_file(default_model_path())


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(28))
    with pytest.raises(ValueError, match="not a little-endian GGUF v2/v3 file"):
        GGUFFile(str(path))

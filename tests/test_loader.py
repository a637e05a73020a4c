"""Model loading: GGUF and Hugging Face checkpoints against transformers' own loading."""

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from llmserve.loader import ResolvedModel, iter_weights, load_config, resolve_model
from llmserve.loader.default_model import DEFAULT_GGUF_FILE, default_model_path
from llmserve.loader.gguf_loader import dequantize_tensor, iter_gguf_tensors, load_gguf_config
from llmserve.loader.hf_loader import iter_hf_tensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONFIG_FIELDS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
]


def _state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's state dict without the tied lm_head (which the GGUF loader does not yield)."""
    state_dict = model.state_dict()
    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight")
    return state_dict


def _assert_same_tensors(ours: dict, ref: dict, atol: float = 0.0) -> None:
    assert sorted(ours) == sorted(ref)
    for name, tensor in ours.items():
        assert tensor.shape == ref[name].shape, name
        if atol == 0 and torch.equal(tensor.float(), ref[name].float()):
            continue  # fast path for the 135M-parameter comparison
        torch.testing.assert_close(tensor.float(), ref[name].float(), atol=atol, rtol=0, msg=name)


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_model() -> ResolvedModel:
    return resolve_model(None)


def test_default_model_path() -> None:
    path = default_model_path()
    assert os.path.isfile(path) and os.path.basename(path) == DEFAULT_GGUF_FILE


def test_default_gguf_weights_match_transformers(default_model, hf_default_model) -> None:
    ours = dict(iter_weights(default_model))
    assert all(tensor.dtype == torch.float32 for tensor in ours.values())
    assert "lm_head.weight" not in ours  # SmolLM2 ties embeddings
    _assert_same_tensors(ours, _state_dict(hf_default_model))


def test_default_gguf_config_matches_transformers(default_model, hf_default_model) -> None:
    ours = load_config(default_model)
    assert ours.architectures == ["LlamaForCausalLM"]
    for field in CONFIG_FIELDS:
        assert getattr(ours, field) == getattr(hf_default_model.config, field), field
    assert (ours.num_key_value_heads, ours.eos_token_id, ours.tie_word_embeddings) == (3, 2, True)


# ---------------------------------------------------------------- dequantization per type

SHAPE = (4, 512)  # HF order: [rows, cols]; cols is a multiple of every block size
# type -> max |error| / max |x| after quantize -> our dequantize
ROUND_TRIP_TOLERANCE = {
    QType.F32: 0.0,
    QType.F16: 1e-3,
    QType.BF16: 1e-2,
    QType.Q8_0: 1e-2,
    QType.Q5_0: 0.05,
    QType.Q5_1: 0.05,
    QType.Q4_0: 0.1,
    QType.Q4_1: 0.1,
    QType.Q4_K: 0.1,
    QType.Q6_K: 0.03,
}


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Reference Q4_K quantizer (ggml block_q4_K layout, plain min/max fit), -> [n, 144] bytes.

    Per 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of
    32, then 128 bytes of 4-bit q. Value = d * scale * q - dmin * min.
    """
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    mins = np.maximum(-blocks.min(-1), 0.0)  # [n, 8]
    scales = (blocks.max(-1) + mins) / 15
    d = (scales.max(-1, keepdims=True) / 63).astype(np.float16)  # [n, 1]
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(scales / d.astype(np.float32)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.maximum(dmin.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[..., None]
    offset = (dmin.astype(np.float32) * m)[..., None]
    q = np.clip(np.round((blocks + offset) / step), 0, 15).astype(np.uint8)  # [n, 8, 32]
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.zeros((len(blocks), 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Reference Q6_K quantizer (ggml block_q6_K layout), -> [n, 210] bytes.

    Per 256 values: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales (one per
    16 values), fp16 d. Value = d * scale * (q - 32).
    """
    blocks = x.reshape(-1, 16, 16).astype(np.float32)
    scales = np.abs(blocks).max(-1) / 31  # [n, 16]
    d = (scales.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(scales / d.astype(np.float32)), 1, 127).astype(np.int8)
    step = (d.astype(np.float32) * sc)[..., None]
    q = (np.clip(np.round(blocks / step), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [n, half, quarter, l]
    low, high = q & 0xF, q >> 4
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], -1
    )
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    n = len(blocks)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1
    )


def _quantize(x: np.ndarray, qtype: QType) -> np.ndarray:
    """[rows, cols] floats -> GGUF data for `qtype` ([rows, bytes] for block types)."""
    if qtype == QType.Q4_K:
        return _quantize_q4_k(x).reshape(x.shape[0], -1)
    if qtype == QType.Q6_K:
        return _quantize_q6_k(x).reshape(x.shape[0], -1)
    return gguf.quants.quantize(x, qtype)


def _random_blocks(rng: np.random.Generator, qtype: QType) -> np.ndarray:
    """Random bytes of a [rows, cols] tensor, with every fp16 field kept finite."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (SHAPE[0] * SHAPE[1] // block_size, type_size), dtype=np.uint8)
    return raw.reshape(SHAPE[0], -1) & np.uint8(0xBF)  # clear an exponent bit: no inf/nan


DEQUANT_ONLY_TYPES = [
    QType.Q2_K,
    QType.Q3_K,
    QType.Q5_K,
    QType.IQ2_XXS,
    QType.IQ2_XS,
    QType.IQ2_S,
    QType.IQ3_XXS,
    QType.IQ3_S,
    QType.IQ1_S,
    QType.IQ1_M,
    QType.IQ4_NL,
    QType.IQ4_XS,
]
PLAIN_TYPES = [np.float64, np.int8, np.int16, np.int32, np.int64]
FAST_TYPES = [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K]


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """One GGUF with a tensor per type; returns (expected values, our dequantized tensors)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    path = str(tmp_path_factory.mktemp("quant") / "types.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    expected: dict[str, np.ndarray] = {}
    for qtype in ROUND_TRIP_TOLERANCE:
        writer.add_tensor(qtype.name, _quantize(x, qtype), raw_dtype=qtype)
        expected[qtype.name] = x
    for qtype in DEQUANT_ONLY_TYPES:
        raw = _random_blocks(rng, qtype)
        writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
        expected[qtype.name] = gguf.quants.dequantize(raw, qtype)
    for qtype in FAST_TYPES:  # random blocks, every field: bit for bit as gguf-py decodes them
        raw = _random_blocks(rng, qtype)
        writer.add_tensor(f"random-{qtype.name}", raw, raw_dtype=qtype)
        expected[f"random-{qtype.name}"] = gguf.quants.dequantize(raw, qtype)
    experts = _random_blocks(rng, QType.Q4_1).reshape(2, SHAPE[0] // 2, -1)  # [E, rows, bytes]
    writer.add_tensor("experts", experts, raw_dtype=QType.Q4_1)
    expected["experts"] = gguf.quants.dequantize(experts, QType.Q4_1)
    for dtype in PLAIN_TYPES:
        values = rng.integers(-100, 100, SHAPE).astype(dtype)
        writer.add_tensor(np.dtype(dtype).name, values)
        expected[np.dtype(dtype).name] = values.astype(np.float32)
    _write_gguf(writer)
    ours = {t.name: dequantize_tensor(t) for t in gguf.GGUFReader(path).tensors}
    return expected, ours


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_TOLERANCE), ids=lambda t: t.name)
def test_dequantize_round_trip(quant_file, qtype: QType) -> None:
    expected, ours = quant_file
    x, tensor = expected[qtype.name], ours[qtype.name]
    assert tensor.dtype == torch.float32 and tuple(tensor.shape) == SHAPE
    max_error = np.abs(tensor.numpy() - x).max() / np.abs(x).max()
    assert max_error <= ROUND_TRIP_TOLERANCE[qtype], max_error


@pytest.mark.parametrize("qtype", DEQUANT_ONLY_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(quant_file, qtype: QType) -> None:
    expected, ours = quant_file
    assert tuple(ours[qtype.name].shape) == SHAPE
    np.testing.assert_array_equal(ours[qtype.name].numpy(), expected[qtype.name])


@pytest.mark.parametrize("name", [f"random-{t.name}" for t in FAST_TYPES] + ["experts"])
def test_fast_dequantize_is_gguf_bit_for_bit(quant_file, name: str) -> None:
    """The types decoded through llmserve's converters and torch (Q4_0, Q4_1, Q8_0, Q4_K,
    Q5_K, Q6_K), on random blocks and a 3-D expert tensor, equal gguf-py's results exactly."""
    expected, ours = quant_file
    assert ours[name].shape == expected[name].shape and ours[name].dtype == torch.float32
    assert np.array_equal(ours[name].numpy().view(np.uint32), expected[name].view(np.uint32))


@pytest.mark.parametrize("dtype", PLAIN_TYPES, ids=lambda t: np.dtype(t).name)
def test_plain_numpy_types(quant_file, dtype) -> None:
    expected, ours = quant_file
    name = np.dtype(dtype).name
    assert ours[name].dtype == torch.float32
    np.testing.assert_array_equal(ours[name].numpy(), expected[name])


# ---------------------------------------------------------------- tiny random GGUF models

TINY_LLAMA = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# HF name (layer part) -> (GGUF name, GGUF type); written independently of the loader's tables
TINY_TENSORS = {
    "model.embed_tokens.weight": ("token_embd.weight", QType.F16),
    "model.norm.weight": ("output_norm.weight", QType.F32),
    "lm_head.weight": ("output.weight", QType.Q8_0),
    "self_attn.q_proj.weight": ("attn_q.weight", QType.Q8_0),
    "self_attn.k_proj.weight": ("attn_k.weight", QType.Q8_0),
    "self_attn.v_proj.weight": ("attn_v.weight", QType.F16),
    "self_attn.q_proj.bias": ("attn_q.bias", QType.F32),
    "self_attn.k_proj.bias": ("attn_k.bias", QType.F32),
    "self_attn.v_proj.bias": ("attn_v.bias", QType.F32),
    "self_attn.o_proj.weight": ("attn_output.weight", QType.Q8_0),
    "mlp.gate_proj.weight": ("ffn_gate.weight", QType.Q4_0),
    "mlp.up_proj.weight": ("ffn_up.weight", QType.Q8_0),
    "mlp.down_proj.weight": ("ffn_down.weight", QType.Q4_0),
    "input_layernorm.weight": ("attn_norm.weight", QType.F32),
    "post_attention_layernorm.weight": ("ffn_norm.weight", QType.F32),
}
# max |error| of each GGUF type on values in [-1, 1] (Q4_0 clips the top step: below 1/8)
TINY_TOLERANCE = {QType.F32: 0.0, QType.F16: 1e-3, QType.Q8_0: 1e-2, QType.Q4_0: 0.13}


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's `permute` of q/k rows (HF rotate-half -> llama.cpp pairwise)."""
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def _gguf_tensor(name: str, weight: np.ndarray, arch: str, config) -> tuple[str, QType, np.ndarray]:
    """HF tensor -> (GGUF name, type, values as llama.cpp's converter stores them)."""
    parts = name.split(".")
    if parts[1] != "layers":
        gguf_name, qtype = TINY_TENSORS[name]
        return gguf_name, qtype, weight
    gguf_name, qtype = TINY_TENSORS[".".join(parts[3:])]
    if arch == "llama" and parts[4] in ("q_proj", "k_proj"):
        heads = config.num_attention_heads if parts[4] == "q_proj" else config.num_key_value_heads
        weight = _llama_cpp_permute(weight, heads)
    return f"blk.{parts[2]}.{gguf_name}", qtype, weight


def _add_metadata(writer: gguf.GGUFWriter, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)


def _write_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_tiny_gguf(path: str, arch: str, model: torch.nn.Module) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    _add_metadata(writer, model.config)
    for name, weight in model.state_dict().items():
        gguf_name, qtype, values = _gguf_tensor(name, weight.numpy(), arch, model.config)
        writer.add_tensor(gguf_name, _quantize(values, qtype), raw_dtype=qtype)
    _write_gguf(writer)


def _random_model(model_cls: type, config_cls: type) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY_LLAMA)).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms are all ones at init: make them random
            param.uniform_(-1, 1)
    return model


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    return _random_model(LlamaForCausalLM, LlamaConfig)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers_and_source(tmp_path, arch: str) -> None:
    model_cls, config_cls = {
        "llama": (LlamaForCausalLM, LlamaConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    }[arch]
    source_model = _random_model(model_cls, config_cls)
    _write_tiny_gguf(str(tmp_path / "tiny.gguf"), arch, source_model)
    ours = dict(iter_gguf_tensors(str(tmp_path / "tiny.gguf")))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    _assert_same_tensors(ours, ref.state_dict())
    # Against the source weights (uniform in [-1, 1]): quantization error only, which also
    # checks the q/k un-permutation independently of transformers.
    for name, weight in source_model.state_dict().items():
        _, qtype, _ = _gguf_tensor(name, weight.numpy(), arch, source_model.config)
        error = (ours[name] - weight).abs().max().item()
        assert error <= TINY_TOLERANCE[qtype], (name, error)

    config = load_gguf_config(str(tmp_path / "tiny.gguf"))
    assert type(config) is config_cls and config.architectures == [model_cls.__name__]
    for field in CONFIG_FIELDS:
        assert getattr(config, field, None) == getattr(ref.config, field, None), field
    assert config.tie_word_embeddings is False


def test_rope_scaling_metadata(tmp_path) -> None:
    path = str(tmp_path / "yarn.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    _add_metadata(writer, LlamaConfig(**TINY_LLAMA))
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_orig_ctx_len(64)
    _write_gguf(writer)
    config = load_gguf_config(path)
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["factor"] == 4.0
    assert config.rope_parameters["original_max_position_embeddings"] == 64
    assert config.rope_parameters["rope_theta"] == TINY_LLAMA["rope_theta"]
    assert config.tie_word_embeddings is True  # no output.weight


# ---------------------------------------------------------------- Hugging Face directories


def test_hf_directory_safetensors_and_shards(tmp_path, tiny_llama) -> None:
    expected = _state_dict(tiny_llama)
    for name, shard_size in (("single", "100MB"), ("sharded", "20KB")):
        model_dir = tmp_path / name
        tiny_llama.save_pretrained(model_dir, max_shard_size=shard_size)
        _assert_same_tensors(dict(iter_hf_tensors(str(model_dir))), expected)
        resolved = resolve_model(str(model_dir))
        assert resolved.kind == "hf" and resolved.gguf_file is None
        assert load_config(resolved).hidden_size == TINY_LLAMA["hidden_size"]
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1


def test_hf_directory_pytorch_bin(tmp_path, tiny_llama) -> None:
    tiny_llama.config.save_pretrained(tmp_path)
    torch.save(tiny_llama.state_dict(), tmp_path / "pytorch_model.bin")
    resolved = resolve_model(str(tmp_path))
    _assert_same_tensors(dict(iter_weights(resolved)), tiny_llama.state_dict())
    assert load_config(resolved).to_dict() == AutoConfig.from_pretrained(tmp_path).to_dict()


def test_hf_directory_without_weights(tmp_path, tiny_llama) -> None:
    tiny_llama.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"No weights.*safetensors.*pytorch_model"):
        list(iter_weights(resolve_model(str(tmp_path))))


# ---------------------------------------------------------------- resolve_model


def test_resolve_default_model() -> None:
    resolved = resolve_model(None)
    assert resolved.kind == "gguf" and resolved.gguf_file == DEFAULT_GGUF_FILE
    assert resolved.weights_path == default_model_path()
    assert resolved.display_name == "SmolLM2-135M-Instruct"


def test_resolve_gguf_file_and_directory(tmp_path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    by_file = resolve_model(str(tmp_path / "a.gguf"))
    by_dir = resolve_model(str(tmp_path))
    for resolved in (by_file, by_dir):
        assert (resolved.kind, resolved.path, resolved.gguf_file) == (
            "gguf",
            str(tmp_path),
            "a.gguf",
        )
    assert by_file.display_name == str(tmp_path / "a.gguf")


def test_resolve_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="expected a .gguf file, a Hugging Face directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="exactly one .gguf"):
        resolve_model(str(tmp_path))  # empty directory
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="Cannot find model"):
        resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        resolve_model(str(tmp_path))


def test_bad_gguf_metadata(tmp_path) -> None:
    _write_gguf(gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert"))
    with pytest.raises(ValueError, match="architecture 'bert' is not supported"):
        load_gguf_config(str(tmp_path / "bert.gguf"))
    _write_gguf(gguf.GGUFWriter(str(tmp_path / "empty.gguf"), "llama"))
    with pytest.raises(ValueError, match="lacks the required key 'llama.attention.head_count'"):
        load_gguf_config(str(tmp_path / "empty.gguf"))

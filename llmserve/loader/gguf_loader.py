"""Read a GGUF checkpoint: a transformers config from its metadata, fp32 tensors in HF layout.

GGUF (llama.cpp's format) differs from a Hugging Face checkpoint in four ways, undone here:

    names     blk.3.attn_q.weight          -> model.layers.3.self_attn.q_proj.weight
    shapes    ne = [in_features, out]      -> [out_features, in] (GGUF lists dims innermost first)
    dtypes    Q4_1 / Q8_0 / Q6_K blocks    -> fp32 (gguf.quants.dequantize)
    rotary    q/k rows of each head interleaved for llama.cpp's pairwise rope (llama only)
              -> HF's rotate-half order
    norms     Gemma's (1 + w) norm weights stored as 1 + w (gemma, gemma2, gemma3) -> w
    experts   one [num_experts, out, in] tensor per projection (qwen3moe, llama with experts)
              -> one tensor per expert

The name mapping is in ``gguf_names.py``. Families not named like Llama (gpt2, starcoder,
gptj, bloom, falcon, gptneox, phi2, mpt) are described in ``gguf_families.py`` (their
configs in ``gguf_family_configs.py``); config extras of the Llama-named ones (Gemma 2/3,
Phi-3, Qwen3-MoE, Mixtral) in ``gguf_arch_configs.py``.
"""

import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from llmserve.loader.gguf_arch_configs import (
    EXTRA_CONFIG,
    feed_forward_length,
    gemma3_config,
    moe_config,
)
from llmserve.loader.gguf_arch_configs import field as _field
from llmserve.loader.gguf_arch_configs import required as _required
from llmserve.loader.gguf_families import FAMILIES, family_quantized, family_tensors
from llmserve.loader.gguf_family_configs import GGUFMeta
from llmserve.loader.gguf_file import GGUFFile
from llmserve.loader.gguf_names import hf_tensor_name
from llmserve.quantization.gguf import (
    FLOAT_TYPES,
    gguf_to_internal,
    is_supported,
    unsupported_type_message,
)
from llmserve.quantization.layout import QuantizedWeight

logger = logging.getLogger(__name__)

# general.architecture -> (config class, HF architecture, q/k rows permuted by the converter)
_ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], str, bool]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM", True),
    "mistral": (LlamaConfig, "LlamaForCausalLM", True),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", False),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", False),
    "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM", False),
    "gemma": (GemmaConfig, "GemmaForCausalLM", False),
    "gemma2": (Gemma2Config, "Gemma2ForCausalLM", False),
    "phi3": (Phi3Config, "Phi3ForCausalLM", False),
    "qwen3moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", False),
}
# llama (or mistral) with `{arch}.expert_count` > 0 is Mixtral.
_MIXTRAL = (MixtralConfig, "MixtralForCausalLM", True)
_WITH_HEAD_DIM = (
    LlamaConfig,
    Qwen3Config,
    GemmaConfig,
    Gemma2Config,
    Qwen3MoeConfig,
    MixtralConfig,
)

# Architectures whose converter stored every norm weight as 1 + w.
_NORM_PLUS_ONE = {"gemma", "gemma2", "gemma3"}
# Types stored as plain numpy arrays, which gguf.quants.dequantize does not handle.
_PLAIN_TYPES = {
    gguf.GGMLQuantizationType.F64,
    gguf.GGMLQuantizationType.I8,
    gguf.GGMLQuantizationType.I16,
    gguf.GGMLQuantizationType.I32,
    gguf.GGMLQuantizationType.I64,
}

# GGUF rope.scaling.* key -> HF rope scaling key
_ROPE_SCALING_KEYS = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def _open_reader(path: str) -> GGUFFile:
    """Parse a GGUF file's header once; its tensors stay memory-mapped."""
    stat = os.stat(path)
    return _cached_reader(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def gguf_reader(path: str) -> GGUFFile:
    """The file's (cached) reader: its metadata fields and tensors."""
    return _open_reader(str(path))


def gguf_architecture(path: str) -> str | None:
    """The file's ``general.architecture`` (llama, qwen2, gemma3, ...)."""
    return _field(_open_reader(str(path)), "general.architecture")


def _architecture(reader: GGUFFile, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES and arch not in FAMILIES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted([*_ARCHITECTURES, *FAMILIES]))}"
        )
    return arch


def _arch_entry(reader: GGUFFile, arch: str) -> tuple[type[PretrainedConfig], str, bool]:
    if arch in ("llama", "mistral") and _field(reader, f"{arch}.expert_count", 0) > 0:
        return _MIXTRAL
    return _ARCHITECTURES[arch]


def _tensor_shapes(reader: GGUFFile) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in Hugging Face order (GGUF's dims reversed)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


def _family_config(reader: GGUFFile, arch: str) -> PretrainedConfig:
    field = functools.partial(_field, reader)
    meta = GGUFMeta(arch, field, _tensor_shapes(reader), _token_ids(reader))
    return FAMILIES[arch].build_config(meta)


def _head_counts(reader: GGUFFile, arch: str) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads); llmserve needs the same for every layer."""
    num_heads = _required(reader, f"{arch}.attention.head_count")
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv", num_heads)
    counts = []
    for key, value in (("head_count", num_heads), ("head_count_kv", num_kv_heads)):
        values = set(value) if isinstance(value, list) else {value}
        if len(values) != 1:
            raise ValueError(f"{arch}.attention.{key} differs between layers: {sorted(values)}")
        counts.append(int(values.pop()))
    return counts[0], counts[1]


def _rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    """HF rope scaling dict from `{arch}.rope.scaling.*` (or the old `rope.scale_linear`)."""
    rope_type = _field(reader, f"{arch}.rope.scaling.type")
    if rope_type is None:
        linear_factor = _field(reader, f"{arch}.rope.scale_linear")
        return None if linear_factor is None else {"rope_type": "linear", "factor": linear_factor}
    if rope_type == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type}
    for gguf_key, hf_key in _ROPE_SCALING_KEYS.items():
        value = _field(reader, f"{arch}.rope.scaling.{gguf_key}")
        if value is not None:
            scaling[hf_key] = value
    return scaling


def _token_ids(reader: GGUFFile) -> dict[str, int]:
    ids = {
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    return {key: int(value) for key, value in ids.items() if value is not None}


def load_gguf_config(path: str) -> PretrainedConfig:
    """Build a transformers config from a GGUF file's metadata (architectures: see
    ``_ARCHITECTURES`` and ``gguf_families.FAMILIES``)."""
    reader = _open_reader(str(path))
    arch = _architecture(reader, path)
    if arch in FAMILIES:
        config = _family_config(reader, arch)
        config.architectures = [FAMILIES[arch].hf_architecture]
        return config
    config_cls, hf_architecture, _ = _arch_entry(reader, arch)
    num_heads, num_kv_heads = _head_counts(reader, arch)
    hidden_size = int(_required(reader, f"{arch}.embedding_length"))
    tensor_names = {tensor.name for tensor in reader.tensors}
    vocab_size = _field(reader, f"{arch}.vocab_size")
    kwargs: dict[str, Any] = dict(
        architectures=[hf_architecture],
        vocab_size=int(vocab_size or len(_required(reader, "tokenizer.ggml.tokens"))),
        hidden_size=hidden_size,
        intermediate_size=feed_forward_length(reader, arch),
        num_hidden_layers=int(_required(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=int(_required(reader, f"{arch}.context_length")),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        **_token_ids(reader),
    )
    if (rope_scaling := _rope_scaling(reader, arch)) is not None:
        kwargs["rope_scaling"] = rope_scaling
    if config_cls in _WITH_HEAD_DIM:
        head_dim = _field(reader, f"{arch}.attention.key_length", hidden_size // num_heads)
        kwargs["head_dim"] = int(head_dim)
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "gemma3":
        kwargs.update(
            gemma3_config(reader, kwargs.pop("rope_theta"), kwargs.pop("rope_scaling", None))
        )
    elif arch in EXTRA_CONFIG:
        kwargs.update(EXTRA_CONFIG[arch](reader, arch, kwargs))
    elif config_cls is MixtralConfig:
        kwargs.update(moe_config(reader, arch))
    if "rope_freqs.weight" in tensor_names:
        logger.warning("%s: rope_freqs.weight (llama3 rope factors) is ignored", path)
    return config_cls(**kwargs)


def dequantize_tensor(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """Dequantize one GGUF tensor to fp32 in HF shape (GGUF's dims reversed). The types
    ``--quantization gguf`` reads are decoded through its converters and torch, with gguf-py's
    operations in its order (bit-identical, about twice as fast as gguf-py's numpy: half a
    second per load of the default model on a slow host); any other type through gguf-py."""
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    if qtype in _FAST_TYPES:
        return _dequantize_blocks(tensor, qtype, shape)
    if qtype in _PLAIN_TYPES:
        array = np.asarray(tensor.data, dtype=np.float32)
    else:
        try:
            array = gguf.quants.dequantize(tensor.data, qtype)
        except NotImplementedError as exc:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has type {qtype.name}, which this gguf "
                "package cannot dequantize"
            ) from exc
    array = array.reshape(shape)
    if not array.flags.writeable or array.dtype != np.float32:
        array = array.astype(np.float32)  # copy off the read-only memory map
    return torch.from_numpy(array)


_QT = gguf.GGMLQuantizationType
_FAST_TYPES = (_QT.Q4_0, _QT.Q4_1, _QT.Q8_0, _QT.Q4_K, _QT.Q5_K, _QT.Q6_K)


def _dequantize_blocks(tensor: gguf.ReaderTensor, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    """gguf-py's formulas, same order: Q4_0 d * (q - 8); Q4_1 d * q + m; Q8_0 q * d; Q4_K and
    Q5_K (d * sc) * q - dmin * m; Q6_K (d * sc) * (q - 32). Rows are independent, so any
    leading dimensions (a MoE layer's experts) are flattened into rows."""
    cols = shape[-1]
    weight = gguf_to_internal(tensor.name, qtype, tensor.data, (int(np.prod(shape[:-1])), cols))
    rows, groups = weight.scales.shape
    values = weight.values().view(rows, groups, -1)  # float32 codes per group (Q4_0: 0..15)
    scales = weight.scales.unsqueeze(-1)
    if qtype == _QT.Q4_0:  # stored as d * q - 8d; gguf-py subtracts 8 first
        out = values.sub_(8.0).mul_(scales)
    elif weight.mins is None:
        out = values.mul_(scales)
    else:  # mins = -(dmin * m): adding it is subtracting dmin * m
        out = values.mul_(scales).add_(weight.mins.unsqueeze(-1))
    return out.reshape(shape)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` of llama q_proj/k_proj rows (weight or bias).

    Per head, HF orders rows [x_0 .. x_{d/2-1} | x_{d/2} .. x_{d-1}] (rotate-half rope);
    the converter interleaves them as [x_0, x_{d/2}, x_1, x_{d/2+1}, ...] for llama.cpp's
    pairwise rope. Viewing each head as [d/2, 2] and transposing to [2, d/2] restores HF order.
    """
    head_dim = weight.shape[0] // num_heads
    # [num_heads, head_dim // 2, 2, *rest] -> [num_heads, 2, head_dim // 2, *rest]
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2)
    return rows.reshape(weight.shape).contiguous()


def _is_quantized(tensor: gguf.ReaderTensor) -> bool:
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    return len(tensor.shape) in (2, 3) and qtype not in _PLAIN_TYPES and qtype not in FLOAT_TYPES


def check_gguf_quantized_types(path: str) -> None:
    """Refuse, before loading anything, a file with a quantized type no kernel computes on."""
    for tensor in _open_reader(str(path)).tensors:
        if _is_quantized(tensor) and not is_supported(tensor.tensor_type):
            raise ValueError(unsupported_type_message(tensor.name, tensor.tensor_type))


def iter_gguf_quantized(path: str) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """As ``iter_gguf_tensors``, but quantized matrices stay quantized: (HF name,
    ``QuantizedWeight`` in HF row order) for those, fp32 tensors for the rest."""
    return _iter_gguf(path, keep_quantized=True)


def _permuted_heads(name: str, is_permuted: bool, num_heads: int, num_kv_heads: int) -> int | None:
    """Head count whose rows the converter interleaved in this tensor, or None."""
    if is_permuted and ".self_attn.q_proj." in name:
        return num_heads
    if is_permuted and ".self_attn.k_proj." in name:
        return num_kv_heads
    return None


def iter_gguf_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, fp32 tensor in HF layout) for every weight in a GGUF file.

    A tied lm_head (no `output.weight` in the file) is not yielded: the config says
    `tie_word_embeddings=True` and the model reuses `model.embed_tokens.weight`.
    """
    return _iter_gguf(path, keep_quantized=False)


def _iter_gguf(path: str, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    reader = _open_reader(str(path))
    arch = _architecture(reader, path)
    if arch in FAMILIES:
        yield from _iter_family(reader, path, arch, keep_quantized)
        return
    is_permuted = _arch_entry(reader, arch)[2]
    num_heads, num_kv_heads = _head_counts(reader, arch)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        if name is None:
            continue
        if "{expert}" in name:
            yield from _split_experts(name, tensor, keep_quantized)
            continue
        heads = _permuted_heads(name, is_permuted, num_heads, num_kv_heads)
        if keep_quantized and _is_quantized(tensor):
            shape = tuple(int(dim) for dim in reversed(tensor.shape))
            weight = gguf_to_internal(tensor.name, tensor.tensor_type, tensor.data, shape)
            if heads is not None:
                weight = weight.select_rows(unpermute_rotary_rows(torch.arange(shape[0]), heads))
        else:
            weight = dequantize_tensor(tensor)
            if heads is not None:
                weight = unpermute_rotary_rows(weight, heads)
            if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
                weight = weight - 1
        yield name, weight


def _split_experts(
    name: str, tensor: gguf.ReaderTensor, keep_quantized: bool
) -> Iterator[tuple[str, Any]]:
    """One ``[num_experts, out, in]`` GGUF tensor -> ``[out, in]`` per expert (each expert's
    rows of blocks as its own quantized weight when ``keep_quantized``)."""
    if keep_quantized and _is_quantized(tensor):
        num_experts, rows, cols = (int(dim) for dim in reversed(tensor.shape))
        blocks = tensor.data.reshape(num_experts, rows, -1)  # [E, out, bytes per row]
        for expert in range(num_experts):
            weight = gguf_to_internal(tensor.name, tensor.tensor_type, blocks[expert], (rows, cols))
            yield name.format(expert=expert), weight
        return
    stacked = dequantize_tensor(tensor)  # [num_experts, out, in]
    for expert, weight in enumerate(stacked):
        yield name.format(expert=expert), weight


def _iter_family(
    reader: GGUFFile, path: str, arch: str, keep_quantized: bool
) -> Iterator[tuple[str, Any]]:
    """The non-Llama families: names and layouts from ``gguf_families`` (quantized matrices
    in HF row order, ``[out, in]``)."""
    family, config = FAMILIES[arch], load_gguf_config(path)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        if name is None:
            continue
        if keep_quantized and _is_quantized(tensor):
            shape = tuple(int(dim) for dim in reversed(tensor.shape))
            weight = gguf_to_internal(tensor.name, tensor.tensor_type, tensor.data, shape)
            yield from family_quantized(family, name, weight, config)
        else:
            yield from family_tensors(family, name, dequantize_tensor(tensor), config)

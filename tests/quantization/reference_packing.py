"""Independent GPTQ / AWQ packers for tests, written from the tools' documented layouts.

They never call llmserve's converters: the packing loops follow AutoGPTQ's ``QuantLinear.pack``
(qweight along in_features, 3 bits as 32 values in 3 words, v1 zeros stored minus one) and
AutoAWQ's ``WQLinear_GEMM.from_linear`` (qweight along out_features, nibble i holding column
``AWQ_ORDER[i]``). ``write_tiny_quantized_checkpoint`` uses them to write a tiny random Llama
checkpoint in either format, for end-to-end loading tests.

Conventions: ``codes`` int64 ``[N, K]`` in 0..2^bits-1, ``zeros`` and ``scales`` ``[N, num_groups]``,
``g_idx`` int64 ``[K]`` (group of each input column), ``W[n, k] = scale * (code - zero)``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def reference_dequantize(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """float32 ``[N, K]``: W[n, k] = scales[n, g_idx[k]] * (codes[n, k] - zeros[n, g_idx[k]])."""
    g = g_idx.long()
    return scales.float()[:, g] * (codes.float() - zeros.float()[:, g])


def make_g_idx(k: int, group_size: int, act_order: bool, seed: int = 0) -> torch.Tensor:
    """int64 ``[K]``: k // G, or (act-order) AutoGPTQ's g_idx[perm[i]] = i // G for a random perm."""
    g = k if group_size == -1 else group_size
    if not act_order:
        return torch.arange(k) // g
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // g
    return g_idx


def random_layer(n, k, bits, group_size, *, sym, act_order, zero_min=0, seed=0):
    """Random ``(codes, zeros, scales fp16-exact fp32, g_idx)`` for an N x K layer."""
    gen = torch.Generator().manual_seed(seed)
    num_groups = k // (k if group_size == -1 else group_size)
    maxq = 2**bits - 1
    codes = torch.randint(0, maxq + 1, (n, k), generator=gen)
    if sym:
        zeros = torch.full((n, num_groups), 2 ** (bits - 1))
    else:  # v1 cannot store zero 0 (stored -1): zero_min=1, up to maxq + 1
        zeros = torch.randint(zero_min, maxq + 1 + zero_min, (n, num_groups), generator=gen)
    scales = (torch.rand(n, num_groups, generator=gen) * 0.02 + 0.001).half().float()
    return codes, zeros, scales, make_g_idx(k, group_size, act_order, seed)


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _pack_gptq_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """uint32 ``[R, C]`` -> ``[R * bits / 32, C]``, AutoGPTQ's loop over rows."""
    out = np.zeros((values.shape[0] // 32 * bits, values.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < out.shape[0]:
        if bits in (2, 4, 8):
            for j in range(i, i + 32 // bits):
                out[row] |= values[j] << np.uint32(bits * (j - i))
            i += 32 // bits
            row += 1
            continue
        for j in range(i, i + 10):
            out[row] |= values[j] << np.uint32(3 * (j - i))
        i += 10
        out[row] |= values[i] << np.uint32(30)
        row += 1
        out[row] |= (values[i] >> np.uint32(2)) & np.uint32(1)
        i += 1
        for j in range(i, i + 10):
            out[row] |= values[j] << np.uint32(3 * (j - i) + 1)
        i += 10
        out[row] |= values[i] << np.uint32(31)
        row += 1
        out[row] |= (values[i] >> np.uint32(1)) & np.uint32(3)
        i += 1
        for j in range(i, i + 10):
            out[row] |= values[j] << np.uint32(3 * (j - i) + 2)
        i += 10
        row += 1
    return out


def pack_gptq(codes, zeros, scales, g_idx, *, bits, checkpoint_format="gptq"):
    """GPTQ tensors ``{qweight, qzeros, scales, g_idx}`` (v1 "gptq" stores zero - 1)."""
    stored_zeros = zeros.long() - (1 if checkpoint_format == "gptq" else 0)
    assert int(stored_zeros.min()) >= 0 and int(stored_zeros.max()) < 2**bits, "zero not storable"
    qweight = _pack_gptq_rows(codes.long().T.numpy().astype(np.uint32), bits)  # [K*b/32, N]
    qzeros = _pack_gptq_rows(stored_zeros.numpy().astype(np.uint32), bits).T  # [G, N*b/32]
    return {
        "qweight": _to_int32(qweight),
        "qzeros": _to_int32(np.ascontiguousarray(qzeros)),
        "scales": scales.T.contiguous().half(),
        "g_idx": g_idx.to(torch.int32),
    }


def _pack_awq_cols(values: np.ndarray) -> np.ndarray:
    """uint32 ``[R, N]`` -> ``[R, N / 8]``, AutoAWQ's loop with its interleaved order."""
    out = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << np.uint32(i * 4)
    return out


def pack_awq(codes, zeros, scales):
    """AWQ GEMM tensors ``{qweight, qzeros, scales}`` (groups are k // G)."""
    return {
        "qweight": _to_int32(_pack_awq_cols(codes.long().T.numpy().astype(np.uint32))),
        "qzeros": _to_int32(_pack_awq_cols(zeros.long().T.numpy().astype(np.uint32))),
        "scales": scales.T.contiguous().half(),
    }


def rtn_quantize(weight, bits, g_idx, *, sym, zero_min=0):
    """Round-to-nearest, AutoGPTQ's quantizer per group: ``(codes, zeros, scales)``."""
    maxq = 2**bits - 1
    num_groups = int(g_idx.max()) + 1
    group_cols = [torch.nonzero(g_idx == g).flatten() for g in range(num_groups)]
    xmin = torch.stack([weight[:, c].min(1).values for c in group_cols], 1).clamp(max=0)
    xmax = torch.stack([weight[:, c].max(1).values for c in group_cols], 1).clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    scales = ((xmax - xmin).clamp(min=1e-5) / maxq).half().float()  # [N, groups]
    if sym:
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    else:
        zeros = torch.round(-xmin / scales).clamp(zero_min, maxq)
    codes = torch.round(weight / scales[:, g_idx] + zeros[:, g_idx]).clamp(0, maxq)
    return codes.long(), zeros.long(), scales


def write_tiny_quantized_checkpoint(
    model_dir: str,
    method: str = "gptq",
    bits: int = 4,
    group_size: int = 32,
    desc_act: bool = False,
    *,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    with_tokenizer: bool = True,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Write a tiny random Llama (hidden 64, 2 layers) quantized RTN as GPTQ or AWQ.

    Every ``*_proj`` weight becomes ``.qweight/.qzeros/.scales`` (+ ``.g_idx`` for GPTQ);
    embeddings, norms and lm_head stay fp16. With ``with_tokenizer`` the default model's
    tokenizer (vocab 49152) is saved too, else the vocab is 256. Returns the dequantized fp32
    state dict (transformers names) to load into ``LlamaForCausalLM`` as the reference.
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(model_dir, exist_ok=True)
    tokenizer = _default_tokenizer() if with_tokenizer else None
    config = LlamaConfig(
        vocab_size=len(tokenizer) if tokenizer is not None else 256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1 if tokenizer is None else tokenizer.bos_token_id,
        eos_token_id=2 if tokenizer is None else tokenizer.eos_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tensors, reference = {}, {}
    for index, (name, param) in enumerate(model.state_dict().items()):
        weight = param.detach().half()  # the checkpoint's fp16 values
        if not (name.endswith("proj.weight") and ".layers." in name):
            tensors[name], reference[name] = weight, weight.float()
            continue
        prefix = name.removesuffix(".weight")
        packed, dequantized = _quantize_linear(
            weight.float(), method, bits, group_size, desc_act, sym, checkpoint_format, seed + index
        )
        tensors.update({f"{prefix}.{key}": value for key, value in packed.items()})
        reference[name] = dequantized
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(model_dir)
    _add_quantization_config(
        model_dir, _quantization_config(method, bits, group_size, desc_act, sym, checkpoint_format)
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(model_dir)
    return reference


def _quantize_linear(weight, method, bits, group_size, desc_act, sym, checkpoint_format, seed):
    """``(packed tensors, dequantized fp32 [N, K])`` of one linear weight."""
    k = weight.shape[1]
    g_idx = make_g_idx(k, group_size, act_order=desc_act and method == "gptq", seed=seed)
    zero_min = 1 if (method, checkpoint_format) == ("gptq", "gptq") else 0
    codes, zeros, scales = rtn_quantize(
        weight, bits, g_idx, sym=sym and method == "gptq", zero_min=zero_min
    )
    if method == "gptq":
        packed = pack_gptq(
            codes, zeros, scales, g_idx, bits=bits, checkpoint_format=checkpoint_format
        )
    else:
        packed = pack_awq(codes, zeros, scales)
    return packed, reference_dequantize(codes, zeros, scales, g_idx)


def _quantization_config(method, bits, group_size, desc_act, sym, checkpoint_format):
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": sym,
            "damp_percent": 0.1,
            "true_sequential": True,
            "checkpoint_format": checkpoint_format,
        }
    assert method == "awq", method
    return {
        "quant_method": "awq",
        "bits": bits,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


def _add_quantization_config(model_dir: str, quantization_config: dict) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    config["dtype"] = config["torch_dtype"] = "float16"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def _default_tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer(None)


def unpack_gptq_reference(tensors, *, bits, in_features, checkpoint_format="gptq"):
    """Independent unpacking of GPTQ tensors, value by value from the documented bit stream
    (value i of a column: bits i*bits .. i*bits+bits-1 of its little-endian words).

    Returns ``(codes [N, K], zeros [N, groups], scales fp32 [N, groups], g_idx [K])``.
    """

    def read_stream(words: np.ndarray, count: int) -> np.ndarray:  # [W, C] -> [count, C]
        words = words.astype(np.uint32).astype(np.uint64)
        out = np.zeros((count, words.shape[1]), dtype=np.int64)
        for i in range(count):
            value = np.zeros(words.shape[1], dtype=np.uint64)
            for b in range(bits):
                bit = i * bits + b
                value |= ((words[bit // 32] >> np.uint64(bit % 32)) & np.uint64(1)) << np.uint64(b)
            out[i] = value.astype(np.int64)
        return out

    qweight = tensors["qweight"].numpy().view(np.uint32)
    qzeros = tensors["qzeros"].numpy().view(np.uint32)
    n = tensors["scales"].shape[1]
    codes = torch.from_numpy(read_stream(qweight, in_features)).T  # [N, K]
    zeros = torch.from_numpy(read_stream(qzeros.T.copy(), n))  # [N, groups]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    return codes, zeros, tensors["scales"].float().T, tensors["g_idx"].long()


def unpack_awq_reference(tensors):
    """Independent unpacking of AWQ gemm tensors: nibble i of word c is column 8c + AWQ_ORDER[i].

    Returns ``(codes [N, K], zeros [N, groups], scales fp32 [N, groups])``.
    """

    def read(words: torch.Tensor) -> torch.Tensor:  # [R, N / 8] -> [N, R]
        words = words.numpy().view(np.uint32)
        out = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.int64)
        for c in range(words.shape[1]):
            for i in range(8):
                out[:, 8 * c + AWQ_ORDER[i]] = (words[:, c] >> np.uint32(4 * i)) & np.uint32(15)
        return torch.from_numpy(out).T

    return read(tensors["qweight"]), read(tensors["qzeros"]), tensors["scales"].float().T

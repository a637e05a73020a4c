"""GPTQ and AWQ checkpoints -> QuantizedWeight, against independent reference packers."""

from __future__ import annotations

import json

import pytest
import torch

from llmserve.quantization.awq import awq_to_internal
from llmserve.quantization.checkpoint_config import (
    CheckpointQuantization,
    parse_quantization_config,
    read_checkpoint_quantization,
)
from llmserve.quantization.gptq import gptq_to_internal
from llmserve.quantization.layout import reference_linear

from .reference_packing import (
    make_g_idx,
    pack_awq,
    pack_gptq,
    random_layer,
    reference_dequantize,
    write_tiny_quantized_checkpoint,
)

N, K = 64, 256


def _gptq(tensors, *, bits, group_size, checkpoint_format, sym=False, desc_act=False, g_idx=True):
    return gptq_to_internal(
        tensors["qweight"],
        tensors["qzeros"],
        tensors["scales"],
        tensors["g_idx"] if g_idx else None,
        bits=bits,
        group_size=group_size,
        desc_act=desc_act,
        sym=sym,
        checkpoint_format=checkpoint_format,
        layer_name="model.layers.0.mlp.up_proj",
    )


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_matches_reference(checkpoint_format, bits, sym, group_size, act_order):
    zero_min = 1 if checkpoint_format == "gptq" else 0
    codes, zeros, scales, g_idx = random_layer(
        N, K, bits, group_size, sym=sym, act_order=act_order, zero_min=zero_min, seed=bits
    )
    tensors = pack_gptq(codes, zeros, scales, g_idx, bits=bits, checkpoint_format=checkpoint_format)
    weight = _gptq(
        tensors,
        bits=bits,
        group_size=group_size,
        checkpoint_format=checkpoint_format,
        sym=sym,
        desc_act=act_order,
    )
    expected = reference_dequantize(codes, zeros, scales, g_idx)  # [N, K]
    torch.testing.assert_close(weight.dequantize_original_order(), expected, atol=1e-6, rtol=0)
    assert weight.bits == (8 if bits == 8 else 4)
    assert weight.group_size == (K if group_size == -1 else group_size)
    assert (weight.perm is not None) == (act_order and group_size != -1)
    assert (weight.mins is None) == (bits == 8 and sym)
    x = torch.randn(3, K)
    torch.testing.assert_close(reference_linear(x, weight), x @ expected.T, atol=1e-5, rtol=1e-5)


def test_gptq_without_g_idx_uses_column_groups():
    codes, zeros, scales, g_idx = random_layer(N, K, 4, 64, sym=False, act_order=False)
    tensors = pack_gptq(codes, zeros, scales, g_idx, bits=4, checkpoint_format="gptq_v2")
    weight = _gptq(tensors, bits=4, group_size=64, checkpoint_format="gptq_v2", g_idx=False)
    expected = reference_dequantize(codes, zeros, scales, g_idx)
    torch.testing.assert_close(weight.dequantize(), expected, atol=1e-6, rtol=0)
    assert weight.perm is None


def test_gptq_act_order_stores_groups_contiguously():
    codes, zeros, scales, g_idx = random_layer(N, K, 4, 32, sym=True, act_order=True)
    tensors = pack_gptq(codes, zeros, scales, g_idx, bits=4, checkpoint_format="gptq")
    weight = _gptq(tensors, bits=4, group_size=32, checkpoint_format="gptq", desc_act=True)
    assert torch.equal(g_idx[weight.perm], torch.arange(K) // 32)
    assert torch.equal(weight.perm, torch.argsort(g_idx, stable=True))


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_matches_reference(group_size):
    codes, zeros, scales, g_idx = random_layer(N, K, 4, group_size, sym=False, act_order=False)
    tensors = pack_awq(codes, zeros, scales)
    weight = awq_to_internal(
        tensors["qweight"],
        tensors["qzeros"],
        tensors["scales"],
        bits=4,
        group_size=group_size,
        layer_name="model.layers.0.self_attn.q_proj",
    )
    expected = reference_dequantize(codes, zeros, scales, g_idx)
    torch.testing.assert_close(weight.dequantize_original_order(), expected, atol=1e-6, rtol=0)
    assert weight.bits == 4 and weight.perm is None and weight.mins is not None


# ---- inconsistent tensors: errors name the layer ----


def _gptq_tensors(bits=4, group_size=32, act_order=False):
    codes, zeros, scales, g_idx = random_layer(
        N, K, bits, group_size, sym=True, act_order=act_order
    )
    return pack_gptq(codes, zeros, scales, g_idx, bits=bits), g_idx


def test_gptq_unequal_groups_raise():
    tensors, g_idx = _gptq_tensors()
    g_idx = g_idx.clone()
    g_idx[0] = 1  # group 0 has 31 columns, group 1 has 33
    tensors["g_idx"] = g_idx.to(torch.int32)
    with pytest.raises(ValueError, match=r"up_proj: g_idx .* groups of exactly 32"):
        _gptq(tensors, bits=4, group_size=32, checkpoint_format="gptq")


@pytest.mark.parametrize(
    ("key", "bad", "match"),
    [
        ("scales", torch.zeros(7, N, dtype=torch.float16), r"up_proj: scales shape \(7, 64\)"),
        ("qzeros", torch.zeros(8, 3, dtype=torch.int32), r"up_proj: qzeros shape \(8, 3\)"),
        ("g_idx", torch.zeros(K + 1, dtype=torch.int32), r"up_proj: g_idx shape \(257,\)"),
        ("qweight", torch.zeros(32, N, dtype=torch.int64), r"up_proj: qweight must be .* int32"),
    ],
)
def test_gptq_shape_errors(key, bad, match):
    tensors, _ = _gptq_tensors()
    tensors[key] = bad
    with pytest.raises(ValueError, match=match):
        _gptq(tensors, bits=4, group_size=32, checkpoint_format="gptq")


def test_gptq_group_size_must_divide_in_features():
    tensors, _ = _gptq_tensors(group_size=-1)
    with pytest.raises(ValueError, match=r"up_proj: group_size=96 does not divide in_features 256"):
        _gptq(tensors, bits=4, group_size=96, checkpoint_format="gptq")


def test_gptq_act_order_needs_g_idx():
    tensors, _ = _gptq_tensors()
    with pytest.raises(ValueError, match=r"up_proj: act-order .* without a g_idx"):
        _gptq(tensors, bits=4, group_size=32, checkpoint_format="gptq", desc_act=True, g_idx=False)


def test_awq_shape_errors():
    codes, zeros, scales, _ = random_layer(N, K, 4, 32, sym=False, act_order=False)
    tensors = pack_awq(codes, zeros, scales)
    with pytest.raises(
        ValueError, match=r"q_proj: scales shape \(8, 64\) does not match \[num_groups=4"
    ):
        awq_to_internal(
            tensors["qweight"],
            tensors["qzeros"],
            tensors["scales"],
            bits=4,
            group_size=64,
            layer_name="q_proj",
        )
    with pytest.raises(ValueError, match=r"q_proj: AWQ bits=8 is not supported; allowed: 4"):
        awq_to_internal(
            tensors["qweight"],
            tensors["qzeros"],
            tensors["scales"],
            bits=8,
            group_size=32,
            layer_name="q_proj",
        )


# ---- checkpoint config detection ----


def _write_json(path, data):
    path.write_text(json.dumps(data))


def test_config_json_gptq(tmp_path):
    _write_json(
        tmp_path / "config.json",
        {
            "model_type": "llama",
            "quantization_config": {
                "quant_method": "gptq",
                "bits": 3,
                "group_size": 128,
                "desc_act": True,
                "sym": False,
                "checkpoint_format": "gptq_v2",
                "damp_percent": 0.01,
            },
        },
    )
    assert read_checkpoint_quantization(str(tmp_path)) == CheckpointQuantization(
        method="gptq",
        bits=3,
        group_size=128,
        desc_act=True,
        sym=False,
        checkpoint_format="gptq_v2",
    )


def test_autogptq_quantize_config_json(tmp_path):
    _write_json(tmp_path / "config.json", {"model_type": "llama"})
    _write_json(
        tmp_path / "quantize_config.json",
        {"bits": 8, "group_size": -1, "desc_act": False, "sym": True, "is_marlin_format": False},
    )
    config = read_checkpoint_quantization(str(tmp_path))
    assert (config.method, config.bits, config.group_size, config.checkpoint_format) == (
        "gptq",
        8,
        -1,
        "gptq",
    )


def test_awq_configs(tmp_path):
    _write_json(
        tmp_path / "config.json",
        {
            "quantization_config": {
                "quant_method": "awq",
                "bits": 4,
                "group_size": 128,
                "zero_point": True,
                "version": "GEMM",
                "modules_to_not_convert": ["visual"],
            }
        },
    )
    config = read_checkpoint_quantization(str(tmp_path))
    assert (config.method, config.bits, config.group_size, config.version) == (
        "awq",
        4,
        128,
        "gemm",
    )
    assert config.modules_to_not_convert == ("visual",)
    autoawq = {"w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"}
    assert parse_quantization_config(autoawq, default_method="awq").group_size == 64
    transformers5 = {"quant_method": "awq", "bits": 4, "format": "gemm", "backend": "auto"}
    assert parse_quantization_config(transformers5).group_size == 128


def test_transformers_config_classes_parse():
    from transformers import AwqConfig, GPTQConfig

    gptq = GPTQConfig(bits=8, group_size=64, desc_act=True, sym=False, format="gptq_v2")
    parsed = parse_quantization_config(gptq.to_dict())
    assert (parsed.method, parsed.bits, parsed.group_size, parsed.desc_act, parsed.sym) == (
        "gptq",
        8,
        64,
        True,
        False,
    )
    assert parsed.checkpoint_format == "gptq_v2"
    awq = parse_quantization_config(AwqConfig(group_size=32).to_dict())
    assert (awq.method, awq.bits, awq.group_size, awq.version) == ("awq", 4, 32, "gemm")


def test_unquantized_checkpoint(tmp_path):
    _write_json(tmp_path / "config.json", {"model_type": "llama"})
    assert read_checkpoint_quantization(str(tmp_path)) is None


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({**GPTQ, "bits": 5}, r"GPTQ bits=5 is not supported; allowed: 2, 3, 4, 8"),
        ({**GPTQ, "group_size": 16}, r"group_size=16 .* -1 .* multiple of 32"),
        ({**GPTQ, "group_size": 0}, r"group_size=0 .* -1 .* multiple of 32"),
        ({**GPTQ, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin' .* 'gptq_v2'"),
        ({**GPTQ, "is_marlin_format": True}, r"checkpoint_format='marlin' is not supported"),
        ({**GPTQ, "pack_dtype": "int16"}, r"pack_dtype='int16' .* allowed: 'int32'"),
        ({**GPTQ, "dynamic": {"-:lm_head": {}}}, r"'dynamic' overrides are not supported"),
        ({**AWQ, "bits": 8}, r"AWQ bits=8 is not supported; allowed: 4"),
        ({**AWQ, "version": "gemv"}, r"version='gemv' .* 'gemm' .*GEMV.*Marlin, ExLlama"),
        ({**AWQ, "version": "exllama"}, r"version='exllama' is not supported"),
        ({**AWQ, "group_size": 48}, r"group_size=48 .* multiple of 32"),
        ({**AWQ, "zero_point": False}, r"zero_point=false is not supported"),
        ({**AWQ, "backend": "llm-awq"}, r"version='llm-awq' is not supported"),
        ({"quant_method": "awq", "format": "gemv_fast"}, r"version='gemv_fast' is not supported"),
        ({"quant_method": "hqq"}, r"quant_method='hqq' is not supported; allowed: 'gptq', 'awq'"),
        ({"quant_method": "bitsandbytes"}, r"'gptq', 'awq' \(pre-quantized bitsandbytes"),
        ({"quant_method": "fp8"}, r"'gptq', 'awq' \(pre-quantized fp8 checkpoints"),
        ({"bits": 4}, r"quant_method=None is not supported; allowed: 'gptq', 'awq'"),
        ({"quant_method": "gptq", "bits": "4"}, r"bits must be an integer, got '4'"),
    ],
)
def test_config_errors(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(raw)


def test_config_error_names_file(tmp_path):
    _write_json(tmp_path / "config.json", {"quantization_config": {**GPTQ, "bits": 6}})
    with pytest.raises(ValueError, match=r"config.json: GPTQ bits=6"):
        read_checkpoint_quantization(str(tmp_path))


# ---- the tiny checkpoint writer round-trips through the converters ----


@pytest.mark.parametrize(
    ("method", "bits", "group_size", "desc_act", "checkpoint_format"),
    [("gptq", 4, 32, True, "gptq"), ("gptq", 8, -1, False, "gptq_v2"), ("awq", 4, 32, False, "")],
)
def test_tiny_checkpoint_round_trip(
    tmp_path, method, bits, group_size, desc_act, checkpoint_format
):
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM

    reference = write_tiny_quantized_checkpoint(
        str(tmp_path),
        method,
        bits,
        group_size,
        desc_act,
        sym=False,
        checkpoint_format=checkpoint_format or "gptq",
        with_tokenizer=False,
    )
    config = read_checkpoint_quantization(str(tmp_path))
    assert (config.method, config.bits, config.group_size) == (method, bits, group_size)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    names = [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]
    assert len(names) == 2 * 7
    for name in names:
        if method == "gptq":
            weight = gptq_to_internal(
                tensors[f"{name}.qweight"],
                tensors[f"{name}.qzeros"],
                tensors[f"{name}.scales"],
                tensors[f"{name}.g_idx"],
                bits=config.bits,
                group_size=config.group_size,
                desc_act=config.desc_act,
                sym=config.sym,
                checkpoint_format=config.checkpoint_format,
                layer_name=name,
            )
        else:
            weight = awq_to_internal(
                tensors[f"{name}.qweight"],
                tensors[f"{name}.qzeros"],
                tensors[f"{name}.scales"],
                bits=config.bits,
                group_size=config.group_size,
                layer_name=name,
            )
        torch.testing.assert_close(
            weight.dequantize_original_order(), reference[f"{name}.weight"], atol=1e-6, rtol=0
        )
    model = LlamaForCausalLM(AutoConfig.from_pretrained(str(tmp_path)))
    model.load_state_dict(reference, strict=True)


def test_make_g_idx_act_order_has_equal_groups():
    g_idx = make_g_idx(256, 64, act_order=True, seed=3)
    assert torch.equal(torch.bincount(g_idx), torch.full((4,), 64))
    assert not torch.equal(g_idx, torch.arange(256) // 64)

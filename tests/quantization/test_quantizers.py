"""llmserve's own quantizers (RTN, GPTQ, AWQ): accuracy on one layer, the packing against an
independent unpacking, tiny quantized models loading and generating, and bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from llmserve.entrypoints.cli import main
from llmserve.quantization.quantizers import awq, quantize
from llmserve.quantization.quantizers.checkpoint_writer import awq_tensors, gptq_tensors
from llmserve.quantization.quantizers.gptq import HessianAccumulator, gptq_quantize
from llmserve.quantization.quantizers.rtn import quantize_rtn

from .reference_packing import (
    pack_awq,
    pack_gptq,
    unpack_awq_reference,
    unpack_gptq_reference,
)
from .tiny_llama import save_tiny_llama

TINY = dict(num_samples=2, seq_len=32)  # calibration small enough for a fast test


def correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """``[tokens, K]`` with correlated features and a few large-magnitude channels."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    channel_scale = torch.rand(k, generator=gen) * 2 + 0.1
    channel_scale[torch.randperm(k, generator=gen)[: k // 32]] *= 10
    return (torch.randn(tokens, k, generator=gen) @ mix) * channel_scale


def output_error(x: torch.Tensor, weight: torch.Tensor, dequantized: torch.Tensor) -> float:
    return float(((x @ (weight - dequantized).T) ** 2).mean())


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_output_error_below_rtn(bits, desc_act, sym):
    n, k = 128, 256
    x = correlated_inputs(2048, k)
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.02
    hessian = HessianAccumulator(k)
    hessian.add(x)
    gptq = gptq_quantize(
        weight, hessian.hessian(), bits=bits, group_size=64, sym=sym, desc_act=desc_act
    )
    rtn = quantize_rtn(weight, bits, 64, sym)
    gptq_error = output_error(x, weight, gptq.dequantize())
    rtn_error = output_error(x, weight, rtn.dequantize())
    assert gptq_error < 0.85 * rtn_error, (gptq_error, rtn_error)
    if desc_act:  # groups follow descending diag(H), not column order
        assert not torch.equal(gptq.g_idx, torch.arange(k) // 64)
        assert torch.bincount(gptq.g_idx).tolist() == [64] * (k // 64)


@pytest.mark.parametrize("sym", [True, False])
def test_mse_range_search_lowers_weight_and_output_error(sym):
    """--mse shrinks each group's range where that rounds better: never worse per row than
    the full range, clearly better on heavy-tailed weights; GPTQ with it beats GPTQ without."""
    from llmserve.quantization.quantizers.rtn import group_params, quantize_values

    torch.manual_seed(2)
    w = torch.distributions.StudentT(2.0).sample((256, 64)) * 0.02  # heavy tails: outliers
    errors = {}
    for mse in (False, True):
        scale, zero = group_params(w, 4, sym, mse=mse)
        q = quantize_values(w, scale, zero, 4)
        errors[mse] = (scale[:, None] * (q - zero[:, None]) - w).abs().pow(2.4).sum(1)
    assert torch.all(errors[True] <= errors[False] * (1 + 1e-5))
    assert errors[True].sum() < 0.97 * errors[False].sum()
    x = correlated_inputs(2048, 256)
    weight = torch.randn(128, 256) * 0.02
    hessian = HessianAccumulator(256)
    hessian.add(x)
    plain, searched = (
        gptq_quantize(weight, hessian.hessian(), bits=4, group_size=64, sym=sym, mse=mse)
        for mse in (False, True)
    )
    assert output_error(x, weight, searched.dequantize()) < output_error(
        x, weight, plain.dequantize()
    )


def test_gptq_dead_inputs_and_rank_deficient_hessian():
    k = 64
    x = correlated_inputs(16, k)  # fewer tokens than features: H is singular
    x[:, 5] = 0  # a dead input column
    hessian = HessianAccumulator(k)
    hessian.add(x)
    weight = torch.randn(32, k)
    result = gptq_quantize(weight, hessian.hessian(), bits=4, group_size=32, sym=True)
    dequantized = result.dequantize()
    assert torch.isfinite(dequantized).all()
    assert output_error(x, weight, dequantized) < output_error(
        x, weight, quantize_rtn(weight, 4, 32, True).dequantize()
    )


def test_awq_scale_search_beats_rtn_and_folding_keeps_the_function():
    k, n, g = 128, 64, 32
    x = correlated_inputs(512, k)[None]  # [1, tokens, K]: one calibration sequence
    prev = torch.nn.Linear(16, k, bias=True)
    linear = torch.nn.Linear(k, n, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.05)
    original = linear.weight.data.clone()
    scales = awq.search_scale(x, [linear], linear, g, num_search=1)
    rtn_error = output_error(x[0], original, awq.fake_quantize(original, g))
    awq_error = output_error(x[0], original, awq.fake_quantize(original * scales, g) / scales)
    assert torch.equal(linear.weight.data, original)  # the search restores the weights
    assert awq_error < 0.9 * rtn_error, (awq_error, rtn_error)
    z = torch.randn(8, 16)
    before = linear(prev(z))
    awq.fold_scale(prev, [linear], scales)
    torch.testing.assert_close(linear(prev(z)), before, rtol=1e-4, atol=1e-5)


def test_awq_clip_lowers_output_error():
    k, n, g = 128, 32, 32
    x = correlated_inputs(512, k)
    weight = torch.randn(n, k) * 0.02
    weight[:, ::17] *= 8  # outlier weights stretch the groups' ranges
    clipped = awq.clip_weight(weight, x, g)
    assert (clipped.abs() <= weight.abs() + 1e-7).all()
    error_clipped = output_error(x, weight, awq.fake_quantize(clipped, g))
    assert error_clipped <= output_error(x, weight, awq.fake_quantize(weight, g))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_packing_round_trips_independent_unpacking(bits, sym):
    n, k = 64, 128
    x = correlated_inputs(256, k)
    weight = torch.randn(n, k) * 0.05
    hessian = HessianAccumulator(k)
    hessian.add(x)
    result = gptq_quantize(
        weight, hessian.hessian(), bits=bits, group_size=32, sym=sym, desc_act=True
    )
    tensors = gptq_tensors(result)
    assert tensors["qweight"].shape == (k * bits // 32, n)
    assert tensors["qzeros"].shape == (k // 32, n * bits // 32)
    assert tensors["scales"].dtype == torch.float16 and tensors["g_idx"].dtype == torch.int32
    codes, zeros, scales, g_idx = unpack_gptq_reference(tensors, bits=bits, in_features=k)
    assert torch.equal(codes, result.codes.long())
    assert torch.equal(zeros, result.zeros)
    assert torch.equal(scales, result.scales)
    assert torch.equal(g_idx, result.g_idx)
    reference = pack_gptq(result.codes, result.zeros, result.scales, result.g_idx, bits=bits)
    for name, tensor in reference.items():
        assert torch.equal(tensors[name], tensor), name


def test_awq_packing_round_trips_independent_unpacking():
    weight = torch.randn(64, 128) * 0.05
    result = quantize_rtn(weight, 4, 32, sym=False, style="awq")
    tensors = awq_tensors(result)
    assert tensors["qweight"].shape == (128, 8) and tensors["qzeros"].shape == (4, 8)
    codes, zeros, scales = unpack_awq_reference(tensors)
    assert torch.equal(codes, result.codes.long())
    assert torch.equal(zeros, result.zeros)
    assert torch.equal(scales, result.scales)
    reference = pack_awq(result.codes, result.zeros, result.scales)
    for name, tensor in reference.items():
        assert torch.equal(tensors[name], tensor), name


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random Llama (hidden 64, 2 layers, GQA, tied embeddings), with its tokenizer."""
    path = str(tmp_path_factory.mktemp("tiny_float"))
    save_tiny_llama(path)
    return path


def generate(model_dir: str) -> list[int]:
    from llmserve import LLM, SamplingParams

    llm = LLM(model=model_dir, max_model_len=128, kv_cache_memory=2**24)
    out = llm.generate(["The list"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "method, options",
    [("rtn", {"bits": 3}), ("gptq", {"bits": 4}), ("gptq", {"bits": 8, "sym": False}), ("awq", {})],
)
def test_quantized_tiny_model_loads_and_generates(tiny_model, tmp_path, method, options):
    output = str(tmp_path / "quantized")
    report = quantize(tiny_model, output, method=method, group_size=32, **TINY, **options)
    assert report.num_layers == 14
    with open(os.path.join(output, "config.json")) as f:
        config = json.load(f)["quantization_config"]
    assert config["quant_method"] == ("awq" if method == "awq" else "gptq")
    assert config["bits"] == options.get("bits", 4) and config["group_size"] == 32
    tensors = load_file(os.path.join(output, "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors
    assert tensors["model.layers.1.mlp.down_proj.qweight"].dtype == torch.int32
    assert "lm_head.weight" not in tensors  # tied to the embedding
    assert os.path.isfile(os.path.join(output, "tokenizer.json"))
    assert os.path.isfile(os.path.join(output, "generation_config.json"))
    token_ids = generate(output)
    assert len(token_ids) == 4


def test_act_order_checkpoint_loads_with_its_g_idx(tiny_model, tmp_path):
    from llmserve import LLM

    output = str(tmp_path / "act_order")
    quantize(tiny_model, output, method="gptq", group_size=32, desc_act=True, **TINY)
    tensors = load_file(os.path.join(output, "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj"
    layer = {key: tensors[f"{prefix}.{key}"] for key in ("qweight", "qzeros", "scales", "g_idx")}
    g_idx = layer["g_idx"].long()
    assert not torch.equal(g_idx, torch.arange(128) // 32)
    assert torch.bincount(g_idx).tolist() == [32] * 4
    codes, zeros, scales, g_idx = unpack_gptq_reference(layer, bits=4, in_features=128)
    expected = scales[:, g_idx] * (codes.float() - zeros[:, g_idx].float())  # [N, K]
    llm = LLM(model=output, max_model_len=64, kv_cache_memory=2**24)
    down = llm.llm_engine.runner.model.layers[0].mlp.down_proj
    (loaded,) = down.parts
    assert torch.equal(loaded.perm, torch.argsort(g_idx, stable=True))
    torch.testing.assert_close(loaded.dequantize_original_order(), expected)


def test_interrupted_write_leaves_no_directory(tiny_model, tmp_path, monkeypatch):
    import transformers

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.GenerationConfig, "save_pretrained", fail)
    with pytest.raises(KeyboardInterrupt):
        quantize(tiny_model, str(tmp_path / "out"), method="rtn", group_size=32)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "options, message",
    [
        ({"method": "squeeze"}, "unknown method 'squeeze'; allowed: rtn, gptq, awq"),
        ({"bits": 5}, "--bits 5 is not allowed for gptq; allowed: 2, 3, 4, 8"),
        ({"method": "awq", "bits": 3}, "allowed: 4"),
        ({"group_size": 48}, "allowed: -1 (one group per row) or a positive multiple of 32"),
        (
            {"group_size": 128},
            "layer model.layers.0.self_attn.q_proj has in_features 64, "
            "not divisible by --group-size 128; allowed for this model: -1 or 32, 64",
        ),
        ({"method": "rtn", "desc_act": True}, "--desc-act is a GPTQ option"),
        ({"method": "awq", "sym": True}, "--sym is not allowed with --method awq"),
    ],
)
def test_bad_options_are_refused_before_any_work(tiny_model, tmp_path, options, message):
    output = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        quantize(tiny_model, str(output), **options)
    assert message in str(info.value)
    assert not output.exists()


def test_calibration_file_errors(tiny_model, tmp_path):
    output = str(tmp_path / "out")
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="does not exist"):
        quantize(tiny_model, output, group_size=32, calibration=missing)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        quantize(tiny_model, output, group_size=32, calibration=str(empty))
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "A few words of calibration text."}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    num_tokens = len(
        tokenizer("A few words of calibration text.", add_special_tokens=False).input_ids
    )
    with pytest.raises(ValueError) as info:
        quantize(
            tiny_model, output, group_size=32, calibration=str(short), num_samples=4, seq_len=16
        )
    assert f"has {num_tokens} tokens, fewer than --num-samples 4 x --seq-len 16 = 64" in str(
        info.value
    )
    assert not os.path.exists(output)


def test_existing_output_refused_without_overwrite(tiny_model, tmp_path, capsys):
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    args = ["quantize", "--model", tiny_model, "--output", str(output), "--method", "rtn"]
    assert main([*args, "--group-size", "32"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (output / "keep.txt").read_text() == "mine"
    assert main([*args, "--group-size", "32", "--overwrite"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert not (output / "keep.txt").exists() and (output / "config.json").exists()

"""Quantized mixture-of-experts layers (Mixtral, Qwen3-MoE): every expert runs quantized.

Each route a user has: a run-time method on the float checkpoint (int8, nf4, llm_int8), a
GGUF file whose stacked expert tensors are quantized blocks (``--quantization gguf``), and a
GPTQ checkpoint that quantizes each expert's projections. Each is checked against
transformers running the same weights dequantized: prompt log-probs within 1e-4 and the
same greedy tokens. The router stays float; a checkpoint quantizing only some experts is
refused.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from llmserve import LLM  # noqa: E402
from llmserve.layers.moe import SparseMoE  # noqa: E402
from llmserve.loader.gguf_loader import iter_gguf_tensors  # noqa: E402
from llmserve.loader.hf_loader import iter_hf_tensors  # noqa: E402
from llmserve.quantization.linear import QuantLinear  # noqa: E402
from llmserve.quantization.llm_int8 import LLMInt8Linear  # noqa: E402
from llmserve.quantization.quantizers.checkpoint_writer import gptq_tensors  # noqa: E402
from llmserve.quantization.quantizers.rtn import quantize_rtn  # noqa: E402
from tests.gguf_writer import write_gguf  # noqa: E402
from tests.test_model_families import LLAMA_LIKE, MOE, _perturb  # noqa: E402

from .reference_packing import unpack_gptq_reference  # noqa: E402
from .test_quantized_families import _assert_matches, _load_reference, _run  # noqa: E402

# Expert sizes that every method can group (multiples of 64: nf4's blocks).
MOE_FAMILIES = {
    "mixtral": lambda: T.MixtralConfig(
        **{**LLAMA_LIKE, "intermediate_size": 128}, num_local_experts=4, **MOE
    ),
    "qwen3-moe": lambda: T.Qwen3MoeConfig(
        **LLAMA_LIKE, moe_intermediate_size=64, num_experts=4, norm_topk_prob=False, **MOE
    ),
}
EXPERT = ".experts."  # in every checkpoint name of an expert's weight


@pytest.fixture(scope="module")
def tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer(None)


def _save(name: str, path, tokenizer=None) -> T.PreTrainedModel:
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(MOE_FAMILIES[name](), dtype=torch.float32)
    _perturb(model)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model.eval()


def _moe_layers(model) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def _assert_experts_quantized(model, num_experts: int) -> None:
    """Every expert projection is a ``QuantLinear``; no stacked float weight is left; the
    routers are float."""
    layers = _moe_layers(model)
    assert layers and all(not hasattr(m, "w13") and not hasattr(m, "w2") for m in layers)
    for moe in layers:
        experts = [*moe.experts13, *moe.experts2]
        assert len(experts) == 2 * num_experts
        assert all(isinstance(layer, QuantLinear) for layer in experts)
        assert not isinstance(moe.gate, QuantLinear | LLMInt8Linear)  # the router: float


def _round_trip(name: str, weight: torch.Tensor, method: str) -> torch.Tensor:
    """``weight`` as ``method`` stores it, dequantized (the router and 1-D tensors as they are)."""
    if weight.dim() != 2 or name.endswith(".gate.weight") or "embed" in name or "lm_head" in name:
        return weight
    if method == "int8":
        from llmserve.quantization.int8 import quantize_int8

        return quantize_int8(weight.float()).dequantize()
    from llmserve.quantization.bnb_4bit import quantize_4bit, to_internal

    return to_internal(quantize_4bit(weight.float(), method, blocksize=64)).dequantize()


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
@pytest.mark.parametrize("method", ["int8", "nf4"])
def test_runtime_method_quantizes_every_expert(name, method, tmp_path, tokenizer):
    model = _save(name, tmp_path, tokenizer)
    state = {n: _round_trip(n, t, method) for n, t in iter_hf_tensors(str(tmp_path))}
    assert any(EXPERT in n for n in state)  # the checkpoint stores one tensor per expert
    reference = _load_reference(model, state)
    llm, outputs = _run(str(tmp_path), quantization=method)
    _assert_experts_quantized(llm.llm_engine.runner.model, 4)
    _assert_matches(llm, outputs, reference)


def test_llm_int8_runs_every_expert(tmp_path, tokenizer):
    """LLM.int8 quantizes activations too (not a weight round trip): every expert is its
    layer, and the greedy tokens follow the float model's for most of the run."""
    _save("qwen3-moe", tmp_path, tokenizer)
    float_llm, float_out = _run(str(tmp_path))
    llm, outputs = _run(str(tmp_path), quantization="llm_int8")
    ours = llm.llm_engine.runner.model
    moe = _moe_layers(ours)[0]
    assert all(isinstance(e, LLMInt8Linear) for e in [*moe.experts13, *moe.experts2])
    for got, expected in zip(outputs, float_out):
        first = got.prompt_logprobs[1:]
        ref = expected.prompt_logprobs[1:]
        for a, b in zip(first, ref):
            shared = set(a) & set(b)
            assert shared and all(abs(a[t] - b[t]) < 0.05 for t in shared)


@pytest.mark.parametrize(("name", "qtype"), [("mixtral", QType.Q4_0), ("qwen3-moe", QType.Q8_0)])
def test_gguf_quantized_experts(name, qtype, tmp_path, tokenizer, monkeypatch):
    """A GGUF file's stacked expert tensors in quantized blocks run as those blocks."""
    model = _save(name, tmp_path / "hf")
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(path, str(tmp_path / "hf"), qtype=qtype)
    state = dict(iter_gguf_tensors(path))  # the blocks dequantized
    assert any(EXPERT in n for n in state)
    reference = _load_reference(model, state)
    monkeypatch.setattr("llmserve.tokenizer.get_tokenizer", lambda *a, **k: tokenizer)
    llm, outputs = _run(path, quantization="gguf")
    _assert_experts_quantized(llm.llm_engine.runner.model, 4)
    _assert_matches(llm, outputs, reference)


def _gptq_moe_checkpoint(path, tokenizer, skip_expert: str | None = None):
    """A GPTQ checkpoint (4-bit, group 32, as GPTQModel writes MoE models) whose expert
    projections are quantized (all but ``skip_expert``, a name prefix); everything else
    float. Returns (the float model, the state transformers should run: every packed layer
    unpacked independently of the loader and dequantized)."""
    model = _save("qwen3-moe", path, tokenizer)
    state = dict(iter_hf_tensors(str(path)))
    tensors = dict(state)
    for name, weight in state.items():
        prefix = name.removesuffix(".weight")
        if EXPERT not in name or (skip_expert and prefix.startswith(skip_expert)):
            continue
        packed = gptq_tensors(quantize_rtn(weight, 4, 32, sym=True, style="gptq"))
        del tensors[name]
        tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
        codes, zeros, scales, g_idx = unpack_gptq_reference(
            packed, bits=4, in_features=weight.shape[1]
        )
        state[name] = scales[:, g_idx] * (codes.float() - zeros[:, g_idx].float())
    weights_file = os.path.join(path, "model.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, weights_file)
    config = T.AutoConfig.from_pretrained(path)
    config.quantization_config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    config.save_pretrained(path)
    return model, state


def test_gptq_checkpoint_with_quantized_experts(tmp_path, tokenizer):
    model, state = _gptq_moe_checkpoint(tmp_path, tokenizer)
    saved = load_file(tmp_path / "model.safetensors")
    assert any(k.endswith(".qweight") and EXPERT in k for k in saved)
    reference = _load_reference(model, state)
    llm, outputs = _run(str(tmp_path))  # detected from quantization_config
    _assert_experts_quantized(llm.llm_engine.runner.model, 4)
    _assert_matches(llm, outputs, reference)


def test_checkpoint_quantizing_some_experts_is_refused(tmp_path, tokenizer):
    _gptq_moe_checkpoint(tmp_path, tokenizer, skip_expert="model.layers.1.mlp.experts.2.")
    with pytest.raises(ValueError, match=r"quantizes only some experts of layers\.1\.mlp"):
        LLM(str(tmp_path), kv_cache_memory=2 << 20, max_model_len=64)

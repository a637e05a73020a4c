"""Quantized checkpoints in the ``decoder.py`` families (not only Llama): GPTQ checkpoints from
llmserve's own quantizer (rtn), AWQ gemm checkpoints, and GGUF files with quantized blocks
load into each family's own layers (fused q/k/v, GPT-2's Conv1D, per-head qkv of Falcon /
BLOOM / GPT-NeoX, Phi-2's split qkv, quantized token tables), and give the prompt log-probs
and greedy tokens of transformers running the same weights dequantized."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.loader.gguf_loader import iter_gguf_tensors  # noqa: E402
from llmserve.quantization.linear import QuantEmbedding, QuantLinear  # noqa: E402
from llmserve.quantization.quantizers import quantize  # noqa: E402
from llmserve.quantization.quantizers.checkpoint_writer import write_checkpoint  # noqa: E402
from llmserve.quantization.quantizers.config import QuantizeOptions  # noqa: E402
from llmserve.quantization.quantizers.pipeline import (  # noqa: E402
    checkpoint_tensors,
    quantization_config,
)
from llmserve.quantization.quantizers.rtn import quantize_rtn  # noqa: E402
from llmserve.quantization.quantizers.source_model import (  # noqa: E402
    is_conv1d,
    linear_layers,
    linear_weight,
)
from tests.conftest import assert_no_leaks  # noqa: E402
from tests.gguf_writer import write_gguf  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    FAMILIES,
    NUM_TOKENS,
    PROMPTS,
    TOP,
    _check_prompt_logprobs,
    _reference,
    _save,
)
from tests.test_model_families_gguf import _model  # noqa: E402

from .reference_packing import unpack_awq_reference, unpack_gptq_reference  # noqa: E402

GROUP = 32
CALIBRATION = dict(num_samples=8, seq_len=64)  # tiny: calibrated from 512 tokens
GPTQ_FAMILIES = [
    "gpt2",
    "opt",
    "falcon-7b-style",
    "falcon-40b-style",
    "gpt-neox",
    "bloom",
    "mpt",
    "gptj",
    "gpt-bigcode-mha",
    "phi",
    "phi3",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "xglm",
    "opt-350m-style",
]
AWQ_FAMILIES = ["gpt2", "falcon-40b-style", "qwen3"]
GGUF_CASES = {  # GGUF family -> block type of every matrix (token table included)
    "gpt2": QType.Q4_0,
    "falcon-40b-style": QType.Q4_1,
    "gptneox": QType.Q8_0,
    "bloom": QType.Q4_0,
    "phi2": QType.Q4_1,
    "gemma": QType.Q8_0,
    "phi3": QType.Q4_0,
    "starcoder": QType.Q8_0,
}


@pytest.fixture(scope="module")
def tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer(None)


def _run(path: str, **kwargs) -> tuple[LLM, list]:
    llm = LLM(
        path,
        kv_cache_memory=2 << 20,
        max_model_len=64,
        block_size=4,
        quantized_activations="float",  # dequantized weights, float32 math: exact up to order
        **kwargs,
    )
    params = SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, prompt_logprobs=TOP
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_no_leaks(llm)
    return llm, outputs


def _assert_matches(llm: LLM, outputs, reference: torch.nn.Module) -> None:
    """Prompt log-probs within 1e-4, and the greedy tokens of ``reference`` with the token
    that ``min_tokens`` masks in llmserve (the tokenizer's EOS) masked there too."""
    ref_logprobs, _ = _reference(reference)
    for output, expected in zip(outputs, ref_logprobs):
        _check_prompt_logprobs(output, expected)
    eos = llm.llm_engine.eos_token_id
    for prompt, output in zip(PROMPTS, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            greedy = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NUM_TOKENS,
                min_new_tokens=NUM_TOKENS,
                pad_token_id=0,
                suppress_tokens=[eos],
            )
        assert output.outputs[0].token_ids == greedy[0, len(prompt) :].tolist()


def _load_reference(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model`` with ``state`` (checkpoint names, float) copied in; a tied head follows."""
    model, info = type(model).from_pretrained(  # renames as transformers does (embed_out)
        None, config=model.config, state_dict=state, dtype=torch.float32, output_loading_info=True
    )
    assert not info["unexpected_keys"], info
    tied = model.config.tie_word_embeddings
    assert set(info["missing_keys"]) <= ({"lm_head.weight"} if tied else set()), info
    return model.eval()


def _dequantized_checkpoint(model, output: str, method: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as floats, every packed layer unpacked independently."""
    tensors = load_file(os.path.join(output, "model.safetensors"))
    state = {k: v.float() for k, v in tensors.items() if k.rpartition(".")[2] == "weight"}
    state |= {k: v.float() for k, v in tensors.items() if k.endswith(".bias")}
    for prefix, module in linear_layers(model).items():
        layer = {k: tensors[f"{prefix}.{k}"] for k in ("qweight", "qzeros", "scales")}
        if method == "gptq":
            layer["g_idx"] = tensors[f"{prefix}.g_idx"]
            k = linear_weight(module).shape[1]
            codes, zeros, scales, g_idx = unpack_gptq_reference(layer, bits=4, in_features=k)
        else:
            codes, zeros, scales = unpack_awq_reference(layer)
            g_idx = torch.arange(codes.shape[1]) // GROUP
        weight = scales[:, g_idx] * (codes.float() - zeros[:, g_idx].float())  # [N, K]
        state[f"{prefix}.weight"] = weight.T if is_conv1d(module) else weight
    return state


def _write_awq(model, output: str, tokenizer) -> None:
    """An AWQ gemm checkpoint of ``model``, every decoder linear rounded AWQ-style."""
    results = {
        prefix: quantize_rtn(linear_weight(module), 4, GROUP, sym=False, style="awq")
        for prefix, module in linear_layers(model).items()
    }
    opts = QuantizeOptions(output=output, method="awq", group_size=GROUP)
    tensors = checkpoint_tensors(model, results, opts)
    write_checkpoint(
        output, tensors, model.config, quantization_config(opts, None), tokenizer, None, False
    )


def _assert_all_quantized(model: torch.nn.Module) -> None:
    """No float linear layer is left in the decoder layers."""
    layers = dict(model.layers.named_modules())
    assert not [n for n, m in layers.items() if isinstance(m, torch.nn.Linear)]
    assert sum(isinstance(m, QuantLinear) for m in layers.values()) >= 4 * len(model.layers)


@pytest.mark.parametrize(
    "name, method",
    [(name, "gptq") for name in GPTQ_FAMILIES] + [(name, "awq") for name in AWQ_FAMILIES],
)
def test_gptq_awq_checkpoint(name, method, tmp_path, tokenizer):
    model = _save(name, tmp_path / "float", tokenizer)
    output = str(tmp_path / method)
    if method == "gptq":
        quantize(str(tmp_path / "float"), output, method="rtn", bits=4, group_size=GROUP)
    else:
        _write_awq(model, output, tokenizer)
    state = _dequantized_checkpoint(model, output, method)
    reference = _load_reference(T.AutoModelForCausalLM.from_config(model.config), state)
    llm, outputs = _run(output)
    _assert_all_quantized(llm.llm_engine.runner.model)
    _assert_matches(llm, outputs, reference)


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_gguf_quantized_blocks(name, tmp_path, tokenizer, monkeypatch):
    model = _model(name)
    model.save_pretrained(tmp_path / "hf")
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(path, str(tmp_path / "hf"), qtype=GGUF_CASES[name])
    state = dict(iter_gguf_tensors(path))  # the blocks dequantized
    reference = _load_reference(T.AutoModelForCausalLM.from_config(model.config), state)
    monkeypatch.setattr("llmserve.tokenizer.get_tokenizer", lambda *a, **k: tokenizer)
    llm, outputs = _run(path, quantization="gguf")
    ours = llm.llm_engine.runner.model
    assert isinstance(ours.embed_tokens, QuantEmbedding)
    _assert_all_quantized(ours)
    _assert_matches(llm, outputs, reference)


def test_quantized_expert_placement():
    """A quantized expert goes to its own layer of the unstacked MoE (gate/up fused)."""
    from llmserve.models.qwen3 import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(FAMILIES["qwen3-moe"](), max_model_len=64)
    placement = model.quantized_placement("model.layers.0.mlp.experts.1.up_proj.weight", 48)
    assert placement[:2] == ("layers.0.mlp.experts13.1.weight", 1)
    placement = model.quantized_placement("model.layers.1.mlp.experts.3.down_proj.weight", 64)
    assert placement[:2] == ("layers.1.mlp.experts2.3.weight", None)
    assert model.quantized_placement("model.layers.0.self_attn.k_proj.weight", 48)[:2] == (
        "layers.0.self_attn.qkv_proj.weight",
        1,
    )


@pytest.mark.parametrize("name", ["gpt2", "falcon-40b-style", "bloom", "gemma3"])
def test_gptq_by_replay(name, tmp_path):
    """GPTQ of a family without Llama-shaped layers (the model itself run up to each layer):
    the checkpoint matches transformers on its dequantized weights, and its logits are not
    further from the float model's than round-to-nearest's."""
    from .tiny_llama import tiny_tokenizer

    model = _save(name, tmp_path / "float", tiny_tokenizer(512))
    errors = {}
    for method in ("gptq", "rtn"):
        output = str(tmp_path / method)
        quantize(str(tmp_path / "float"), output, method=method, group_size=GROUP, **CALIBRATION)
        state = _dequantized_checkpoint(model, output, "gptq")
        reference = _load_reference(T.AutoModelForCausalLM.from_config(model.config), state)
        errors[method] = _logit_error(model, reference)
    llm, outputs = _run(str(tmp_path / "gptq"))
    _assert_all_quantized(llm.llm_engine.runner.model)
    _assert_matches(llm, outputs, reference_of(model, tmp_path / "gptq"))
    # On tiny random models GPTQ's gain varies (gpt2 about 40x, qwen3 none): never worse.
    assert errors["gptq"] < 1.05 * errors["rtn"], errors


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_qwen3_runs_in_stages(method, tmp_path):
    """Qwen3 (q/k norms) is quantized stage by stage like Llama, so AWQ can fold its scales:
    the checkpoint loads, matches transformers on its dequantized weights, and its logits are
    not further from the float model's than round-to-nearest's."""
    from .tiny_llama import tiny_tokenizer

    model = _save("qwen3", tmp_path / "float", tiny_tokenizer(512))
    errors = {}
    for m in (method, "rtn"):
        output = str(tmp_path / m)
        quantize(
            str(tmp_path / "float"), output, method=m, group_size=GROUP, num_samples=32, seq_len=64
        )
        state = _dequantized_checkpoint(model, output, "awq" if m == "awq" else "gptq")
        reference = _load_reference(T.AutoModelForCausalLM.from_config(model.config), state)
        errors[m] = _logit_error(model, reference)
        if m == method:
            llm, outputs = _run(output)
            _assert_all_quantized(llm.llm_engine.runner.model)
            _assert_matches(llm, outputs, reference)
    assert errors[method] < 1.05 * errors["rtn"], errors


def reference_of(model, output) -> torch.nn.Module:
    state = _dequantized_checkpoint(model, str(output), "gptq")
    return _load_reference(T.AutoModelForCausalLM.from_config(model.config), state)


def _logit_error(model: torch.nn.Module, quantized: torch.nn.Module) -> float:
    """Mean squared logit difference on calibration-like text (pydoc's second half)."""
    from llmserve.eval.text_source import pydoc_text

    from .tiny_llama import tiny_tokenizer

    text = pydoc_text()[-20_000:]
    ids = torch.tensor([tiny_tokenizer(512).encode(text)[:96]])  # within GPT-2's 128 positions
    with torch.no_grad():
        return float(((model(ids).logits - quantized(ids).logits) ** 2).mean())

"""--quantization gguf: a GGUF file's blocks converted exactly, computed on directly."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import LlamaConfig, LlamaForCausalLM

from llmserve.config import EngineConfig
from llmserve.loader import resolve_model
from llmserve.loader.gguf_loader import load_gguf_config
from llmserve.quantization.gguf import SUPPORTED_TYPES, gguf_to_internal
from llmserve.quantization.linear import QuantEmbedding, QuantLinear
from llmserve.quantization.loading import weight_bytes_by_dtype
from llmserve.runner.worker import load_model, resolve_dtype
from tests.conftest import NUM_TOKENS, PROMPTS
from tests.test_loader import _add_metadata, _gguf_tensor, _quantize, _write_gguf

ROWS, COLS = 3, 512


def _random_gguf_blocks(rng: np.random.Generator, qtype: QType) -> np.ndarray:
    """Random bytes of a [ROWS, COLS] tensor of ``qtype``, every fp16 field finite."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (ROWS, COLS // block_values, block_bytes), dtype=np.uint8)
    return (raw & np.uint8(0xBF)).reshape(ROWS, -1)  # an exponent bit cleared: no inf/nan


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_conversion_is_exact(qtype: QType) -> None:
    raw = _random_gguf_blocks(np.random.default_rng(int(qtype)), qtype)
    reference = gguf.quants.dequantize(raw, qtype).reshape(ROWS, COLS)
    weight = gguf_to_internal("t", qtype, raw, (ROWS, COLS))
    assert weight.bits == (4 if qtype in (QType.Q4_0, QType.Q4_1, QType.Q4_K) else 8)
    np.testing.assert_array_equal(weight.dequantize().numpy(), reference)


# A tiny Llama whose every projection has its own GGUF type (a fused qkv of three types).
TINY = dict(
    vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip
TYPES = {
    "model.embed_tokens.weight": ("token_embd.weight", QType.Q8_0),
    "model.norm.weight": ("output_norm.weight", QType.F32),
    "lm_head.weight": ("output.weight", QType.Q6_K),
    "self_attn.q_proj.weight": ("attn_q.weight", QType.Q4_K),
    "self_attn.k_proj.weight": ("attn_k.weight", QType.Q4_0),
    "self_attn.v_proj.weight": ("attn_v.weight", QType.Q6_K),
    "self_attn.o_proj.weight": ("attn_output.weight", QType.Q8_0),
    "mlp.gate_proj.weight": ("ffn_gate.weight", QType.Q4_1),
    "mlp.up_proj.weight": ("ffn_up.weight", QType.Q4_1),
    "mlp.down_proj.weight": ("ffn_down.weight", QType.Q4_0),
    "input_layernorm.weight": ("attn_norm.weight", QType.F32),
    "post_attention_layernorm.weight": ("ffn_norm.weight", QType.F32),
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    import tests.test_loader as loader_tests

    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    _add_metadata(writer, source.config)
    saved = loader_tests.TINY_TENSORS
    loader_tests.TINY_TENSORS = TYPES  # _gguf_tensor reads the name/type table from there
    try:
        for name, weight in source.state_dict().items():
            gguf_name, qtype, values = _gguf_tensor(name, weight.numpy(), "llama", source.config)
            writer.add_tensor(gguf_name, _quantize(values, qtype), raw_dtype=qtype)
    finally:
        loader_tests.TINY_TENSORS = saved
    _write_gguf(writer)
    return path


def _load(path: str, backend: str, **options):
    resolved = resolve_model(path)
    config = EngineConfig.from_kwargs(model=path, **options)
    hf_config = load_gguf_config(resolved.weights_path)
    cpu = torch.device("cpu")
    dtype = resolve_dtype(config.model.dtype, cpu)
    return load_model(resolved, hf_config, config, 64, dtype, cpu, backend)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_tiny_model_layers_equal_dequantized_file(tiny_gguf: str, backend: str) -> None:
    """Every quantized layer holds exactly the file's values (in the model's row order, q/k
    interleaved for the cpp rotary kernel), and computes close to the float layer."""
    dense = _load(tiny_gguf, backend)
    quant = _load(tiny_gguf, backend, quantization="gguf")
    x = torch.randn(5, 512)
    num_quantized = 0
    for name, module in quant.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        num_quantized += 1
        dense_layer = dense.get_submodule(name)
        dense_weight = getattr(dense_layer, "weight", None)
        if dense_weight is None:  # oneDNN-packed: recover W from the layer itself
            dense_weight = dense_layer(torch.eye(module.in_features)).T
        ours = torch.cat([p.dequantize() for p in module.parts])
        torch.testing.assert_close(ours, dense_weight, rtol=1e-5, atol=1e-6)
        xin = x[:, : module.in_features]
        out, ref = module(xin), xin @ ours.T
        assert (out - ref).norm() / ref.norm() < 0.02, name
    assert num_quantized == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the LM head
    qkv = quant.layers[0].self_attn.qkv_proj
    assert len(qkv.parts) == 3  # Q4_K, Q4_0 and Q6_K rows stay separate parts
    assert len(quant.layers[0].mlp.gate_up_proj.parts) == 1  # two Q4_1 parts fused
    assert isinstance(quant.embed_tokens, QuantEmbedding)
    ids = torch.tensor([3, 0, 127])
    torch.testing.assert_close(quant.embed_tokens(ids), dense.embed_tokens(ids))


def test_default_model_greedy_and_bytes(hf_greedy_reference) -> None:
    """The default Q4_1 file computed on its blocks: greedy text mostly equal to transformers
    on the dequantized weights (int8 activations change a few near-ties), 4-bit bytes."""
    from llmserve import LLM, SamplingParams

    llm = LLM(quantization="gguf", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    same_prefix = [
        _common_prefix(out.outputs[0].token_ids, ref) / NUM_TOKENS
        for out, ref in zip(outputs, hf_greedy_reference)
    ]
    print("matching-prefix fraction per prompt:", same_prefix)
    assert sum(f == 1.0 for f in same_prefix) >= len(PROMPTS) // 2
    assert np.mean(same_prefix) >= 0.7
    model = llm.llm_engine.runner.model
    quantized_bytes = sum(weight_bytes_by_dtype(model).values())
    reader = gguf.GGUFReader(resolve_model(None).weights_path)
    fp32_bytes = 4 * sum(int(t.n_elements) for t in reader.tensors)  # every weight in fp32
    assert quantized_bytes <= 0.3 * fp32_bytes


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_errors(tiny_gguf: str, tmp_path) -> None:
    with pytest.raises(ValueError, match="bfloat16 conflicts"):
        _load(tiny_gguf, "torch", quantization="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="needs a GPTQ checkpoint"):
        _load(tiny_gguf, "torch", quantization="gptq")
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig.from_kwargs(quantization="int3")
    path = str(tmp_path / "q5_0.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    _add_metadata(writer, LlamaConfig(**TINY))
    writer.add_tensor(
        "blk.0.attn_q.weight",
        _quantize(np.ones((256, 256), np.float32), QType.Q5_0),
        raw_dtype=QType.Q5_0,
    )
    _write_gguf(writer)
    with pytest.raises(ValueError, match=r"Q5_0.*supported: Q4_0.*omit --quantization gguf"):
        _load(path, "torch", quantization="gguf")

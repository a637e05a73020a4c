"""AWQ beyond Llama-shaped layers (``awq_groups.py``, ``awq_replay.py``), on tiny random
models of every family llmserve runs:

- folding random positive scales through every scaling group leaves transformers' logits
  unchanged (a forgotten LayerNorm bias, Gemma's 1 + w, GPT-2's Conv1D transpose, a group
  missing a linear its norm feeds would all show);
- ``quantize(method="awq")`` writes an AWQ gemm checkpoint that ``LLM(model=DIR)`` loads with
  no flag, matches transformers on the dequantized weights, and is no further from the float
  model than AWQ-style round-to-nearest;
- a layer's output error after AWQ is not above round-to-nearest's on the search samples.
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402

from llmserve.quantization.quantizers import quantize  # noqa: E402
from llmserve.quantization.quantizers.awq import fold_scale  # noqa: E402
from llmserve.quantization.quantizers.awq_groups import FAMILY_GROUPS, scaling_groups  # noqa: E402
from llmserve.quantization.quantizers.awq_replay import (  # noqa: E402
    awq_layer_by_replay,
    capture_layer_calls,
    layer_outputs,
)
from llmserve.quantization.quantizers.pipeline import check_calibrated_architecture  # noqa: E402
from llmserve.quantization.quantizers.rtn import quantize_rtn  # noqa: E402
from llmserve.quantization.quantizers.source_model import (  # noqa: E402
    decoder_layers,
    is_conv1d,
    linear_layers,
    linear_weight,
)
from tests.test_model_families import FAMILIES, _perturb  # noqa: E402

from .test_quantized_families import (  # noqa: E402
    GROUP,
    _assert_all_quantized,
    _assert_matches,
    _dequantized_checkpoint,
    _load_reference,
    _logit_error,
    _run,
    _save,
)

# Family -> (prev module, linears) of each scaling group in a decoder layer: the table as
# these tiny configs resolve it (GQA drops v -> o, a GELU drops fc1 -> fc2).
EXPECTED_GROUPS = {
    "gpt2": [("ln_1", ["attn.c_attn"]), ("ln_2", ["mlp.c_fc"])],
    "opt": [
        ("self_attn_layer_norm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        ("self_attn.v_proj", ["self_attn.out_proj"]),
        ("final_layer_norm", ["fc1"]),
        ("fc1", ["fc2"]),
    ],
    "opt-350m-style": [("self_attn.v_proj", ["self_attn.out_proj"]), ("fc1", ["fc2"])],
    "bloom": [
        ("input_layernorm", ["self_attention.query_key_value"]),
        ("post_attention_layernorm", ["mlp.dense_h_to_4h"]),
    ],
    "mpt": [("norm_1", ["attn.Wqkv"]), ("norm_2", ["ffn.up_proj"])],
    "falcon-7b-style": [
        ("input_layernorm", ["self_attention.query_key_value", "mlp.dense_h_to_4h"])
    ],
    "falcon-40b-style": [
        ("ln_attn", ["self_attention.query_key_value"]),
        ("ln_mlp", ["mlp.dense_h_to_4h"]),
    ],
    "gpt-neox": [
        ("input_layernorm", ["attention.query_key_value"]),
        ("post_attention_layernorm", ["mlp.dense_h_to_4h"]),
    ],
    "gptj": [
        ("ln_1", ["attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"]),
        ("attn.v_proj", ["attn.out_proj"]),
    ],
    "phi": [
        ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1"])
    ],
    "phi3": [
        ("input_layernorm", ["self_attn.qkv_proj"]),
        ("post_attention_layernorm", ["mlp.gate_up_proj"]),
        ("mlp.gate_up_proj", ["mlp.down_proj"]),
    ],
    "gemma": [
        ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"]),
        ("mlp.up_proj", ["mlp.down_proj"]),
    ],
    "gemma2": [
        ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        ("pre_feedforward_layernorm", ["mlp.gate_proj", "mlp.up_proj"]),
        ("mlp.up_proj", ["mlp.down_proj"]),
    ],
    "xglm": [
        ("self_attn_layer_norm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        ("self_attn.v_proj", ["self_attn.out_proj"]),
        ("final_layer_norm", ["fc1"]),
    ],
    "mixtral": [("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])],
}
EXPECTED_GROUPS["gpt-neox-sequential"] = EXPECTED_GROUPS["gpt-neox"]
EXPECTED_GROUPS["gpt-bigcode"] = EXPECTED_GROUPS["gpt-bigcode-mha"] = EXPECTED_GROUPS["gpt2"]
EXPECTED_GROUPS["gemma3"] = EXPECTED_GROUPS["gemma2"]
EXPECTED_GROUPS["qwen3-moe"] = EXPECTED_GROUPS["mixtral"]
CHECKPOINT_FAMILIES = ["gpt2", "opt", "bloom", "falcon-7b-style", "gpt-neox", "gemma", "phi"]
CHECKPOINT_FAMILIES += ["gemma3", "phi3", "mixtral"]
MOE = ("mixtral", "qwen3-moe")


@pytest.fixture(scope="module")
def tokenizer():
    from .tiny_llama import tiny_tokenizer

    return tiny_tokenizer(512)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(FAMILIES[name](), dtype=torch.float32)
    _perturb(model)
    return model.eval()


def test_every_family_but_llama_shaped_has_a_table():
    types = {FAMILIES[name]().model_type for name in FAMILIES}
    assert types - set(FAMILY_GROUPS) == {"qwen3", "mistral", "qwen2"}  # awq.py's stage path
    assert set(EXPECTED_GROUPS) == {
        name for name in FAMILIES if FAMILIES[name]().model_type in FAMILY_GROUPS
    }


@pytest.mark.parametrize("name", list(EXPECTED_GROUPS))
def test_folding_random_scales_keeps_the_logits(name):
    model = _model(name)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    _, layers = decoder_layers(model)
    names = {id(m): n for n, m in layers[0].named_modules()}
    groups = scaling_groups(layers[0], model.config.model_type)
    assert [(names[id(g.prev)], g.names) for g in groups] == EXPECTED_GROUPS[name]
    generator = torch.Generator().manual_seed(2)
    for layer in layers:
        for group in scaling_groups(layer, model.config.model_type):
            k = linear_weight(group.linears[0]).shape[1]
            scales = torch.exp(torch.randn(k, generator=generator) * 0.7)  # [K], 0.1 .. 10
            fold_scale(group.prev, group.linears, scales, group.norm_offset)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=0)


def _rtn_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every decoder linear rounded AWQ-style (asymmetric, group 32)."""
    rounded = copy.deepcopy(model)
    for module in linear_layers(rounded).values():
        weight = quantize_rtn(linear_weight(module), 4, GROUP, sym=False, style="awq").dequantize()
        module.weight.data = weight.T.contiguous() if is_conv1d(module) else weight
    return rounded


@pytest.mark.parametrize("name", CHECKPOINT_FAMILIES)
def test_awq_checkpoint_loads_and_follows_the_float_model(name, tmp_path, tokenizer):
    model = _save(name, tmp_path / "float", tokenizer)
    output = str(tmp_path / "awq")
    report = quantize(
        str(tmp_path / "float"), output, method="awq", group_size=GROUP, num_samples=8, seq_len=64
    )
    assert report.num_layers == len(linear_layers(model))
    state = _dequantized_checkpoint(model, output, "awq")
    reference = _load_reference(T.AutoModelForCausalLM.from_config(model.config), state)
    llm, outputs = _run(output)  # no quantization flag: read from quantization_config
    if name not in MOE:  # experts stay float, as rtn and gptq leave them
        _assert_all_quantized(llm.llm_engine.runner.model)
    _assert_matches(llm, outputs, reference)
    errors = (_logit_error(model, reference), _logit_error(model, _rtn_model(model)))
    assert errors[0] <= 1.05 * errors[1], errors


def _layer_error(layer, calls, hidden, reference, results=None) -> float:
    """Output error of ``layer`` on the chunks with each linear's quantized weight (from
    ``results``, or rounded AWQ-style)."""
    for name, module in layer.named_modules():
        if isinstance(module, torch.nn.Linear) or is_conv1d(module):
            result = results[name] if results else None
            if result is None:
                result = quantize_rtn(linear_weight(module), 4, GROUP, sym=False, style="awq")
            weight = result.dequantize()  # [N, K]
            module.weight.data = weight.T.contiguous() if is_conv1d(module) else weight
    return float((layer_outputs(layer, calls, hidden) - reference).pow(2).mean())


@pytest.mark.parametrize("name", ["gpt2", "opt", "falcon-7b-style", "gemma"])
def test_awq_layer_error_is_not_above_rtn(name, tokenizer):
    model = _model(name)
    tokens = torch.randint(3, 500, (4, 48), generator=torch.Generator().manual_seed(3))
    _, layers = decoder_layers(model)
    hidden, calls = capture_layer_calls(model, layers, list(tokens.split(2)))
    reference = layer_outputs(layers[0], calls[0], hidden)
    rtn_error = _layer_error(copy.deepcopy(layers[0]), calls[0], hidden, reference)
    layer = copy.deepcopy(layers[0])
    outputs, results = awq_layer_by_replay(
        layer, model.config.model_type, calls[0], hidden, GROUP, search_chunks=2
    )
    torch.testing.assert_close(torch.cat(outputs), reference)  # the float output, next input
    awq_error = _layer_error(layer, calls[0], hidden, reference, results)
    assert awq_error <= rtn_error, (awq_error, rtn_error)


def test_a_family_without_a_table_is_named():
    with pytest.raises(ValueError, match="model_type 'stablelm'.*use --method gptq or rtn"):
        check_calibrated_architecture(SimpleNamespace(model_type="stablelm"), "awq")
    check_calibrated_architecture(SimpleNamespace(model_type="stablelm"), "gptq")
    opt_layer = _model("opt").model.decoder.layers[0]
    with pytest.raises(ValueError, match="none of the gpt2 module layouts"):
        scaling_groups(opt_layer, "gpt2")

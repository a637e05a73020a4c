"""AWQ's scaling groups per family: which module's output feeds which linear layers, so that
a per-input-channel scale ``s`` can be folded there (the linears' columns times ``s``, that
module's output divided by ``s``) without changing the float model. As AutoAWQ's
``get_layers_for_scaling``, a table of module names per ``model_type``:

    (a) the norm before attention -> q/k/v or the fused qkv (c_attn, query_key_value, Wqkv,
        qkv_proj); where one norm feeds attention and MLP in parallel (GPT-J, Phi, Falcon-7B)
        the MLP's first linear joins the group
    (b) v_proj -> o_proj, only where v is its own linear as wide as o's input (no GQA/MQA)
    (c) the norm before the MLP -> gate/up, fc1, c_fc, dense_h_to_4h
    (d) up -> down in gated MLPs (Phi-3: the up half of the fused gate_up_proj), and
        fc1 -> fc2 where a ReLU sits between (OPT: relu(x / s) = relu(x) / s for s > 0)

Where a GELU sits between the MLP's two linears (GPT-2, BLOOM, Falcon, GPT-J, GPT-NeoX, MPT,
Phi, XGLM, StarCoder) the second linear gets no scale, only the clipping search: AutoAWQ
scales it through a ``ScaledActivation`` module, which the standard checkpoint layout has no
place for. No norm group where the norm's output is also the residual (post-LN OPT, BLOOM's
``apply_residual_connection_post_layernorm``). Mixture-of-experts layers (Mixtral, Qwen3-MoE)
have only the attention groups: their experts are stacked tensors that rtn and gptq leave
float too, and the router reads the MLP norm's output. A family's first alternative whose
modules all exist is used (Falcon: two norms, sequential, or one shared norm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from llmserve.quantization.quantizers.source_model import is_conv1d, linear_weight


def _always(layer, prev, linears) -> bool:
    return True


@dataclass(frozen=True)
class GroupSpec:
    """``prev`` (module name in the decoder layer) feeds every one of ``linears``."""

    prev: str
    linears: tuple[str, ...]
    when: Callable[[nn.Module, nn.Module, list[nn.Module]], bool] = _always
    """(layer, prev, linears) -> whether the fold keeps the function for this layer."""


@dataclass
class ScalingGroup:
    """One group resolved in a decoder layer."""

    prev: nn.Module
    names: list[str]
    linears: list[nn.Module]
    norm_offset: float
    """Gemma's norms compute ``x_hat * (1 + w)``: 1.0; else 0."""


def _pre_norm(layer: nn.Module, prev, linears) -> bool:
    """The norm's output feeds only the linears, not the residual stream."""
    post_norm = not getattr(layer, "do_layer_norm_before", True)  # OPT-350m
    return not (post_norm or getattr(layer, "apply_residual_connection_post_layernorm", False))


def _same_width(layer, prev: nn.Module, linears: list[nn.Module]) -> bool:
    """``prev``'s outputs are exactly the linears' inputs (v -> o without grouped heads)."""
    return linear_weight(prev).shape[0] == linear_weight(linears[0]).shape[1]


def _relu_between(layer: nn.Module, prev, linears) -> bool:
    return isinstance(getattr(layer, "activation_fn", None), nn.ReLU)


def _g(prev: str, *linears: str, when=_always) -> GroupSpec:
    return GroupSpec(prev, linears, when)


QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GPT2_LIKE = (_g("ln_1", "attn.c_attn"), _g("ln_2", "mlp.c_fc"))
OPT_LIKE = (
    _g("self_attn_layer_norm", *QKV, when=_pre_norm),
    _g("self_attn.v_proj", "self_attn.out_proj", when=_same_width),
    _g("final_layer_norm", "fc1", when=_pre_norm),
    _g("fc1", "fc2", when=_relu_between),
)
GEMMA2_LIKE = (
    _g("input_layernorm", *QKV),
    _g("self_attn.v_proj", "self_attn.o_proj", when=_same_width),
    _g("pre_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj"),
    _g("mlp.up_proj", "mlp.down_proj"),
)
MOE_ATTENTION = (
    _g("input_layernorm", *QKV),
    _g("self_attn.v_proj", "self_attn.o_proj", when=_same_width),
)
FALCON_QKV, FALCON_FC = "self_attention.query_key_value", "mlp.dense_h_to_4h"

# model_type -> alternatives (the first whose modules all exist), each a tuple of groups.
FAMILY_GROUPS: dict[str, tuple[tuple[GroupSpec, ...], ...]] = {
    "gpt2": (GPT2_LIKE,),
    "gpt_bigcode": (GPT2_LIKE,),
    "opt": (OPT_LIKE,),
    "xglm": (OPT_LIKE,),
    "bloom": (
        (
            _g("input_layernorm", "self_attention.query_key_value", when=_pre_norm),
            _g("post_attention_layernorm", "mlp.dense_h_to_4h", when=_pre_norm),
        ),
    ),
    "mpt": ((_g("norm_1", "attn.Wqkv"), _g("norm_2", "ffn.up_proj")),),
    "falcon": (
        (_g("ln_attn", FALCON_QKV), _g("ln_mlp", FALCON_FC)),  # 40B-style
        (_g("input_layernorm", FALCON_QKV), _g("post_attention_layernorm", FALCON_FC)),
        (_g("input_layernorm", FALCON_QKV, FALCON_FC),),  # 7B-style parallel attention
    ),
    "gpt_neox": (  # parallel residual or not, each branch has its own norm
        (
            _g("input_layernorm", "attention.query_key_value"),
            _g("post_attention_layernorm", "mlp.dense_h_to_4h"),
        ),
    ),
    "gptj": (
        (
            _g("ln_1", "attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"),
            _g("attn.v_proj", "attn.out_proj", when=_same_width),
        ),
    ),
    "phi": (
        (
            _g("input_layernorm", *QKV, "mlp.fc1"),
            _g("self_attn.v_proj", "self_attn.dense", when=_same_width),
        ),
    ),
    "phi3": (
        (
            _g("input_layernorm", "self_attn.qkv_proj"),
            _g("post_attention_layernorm", "mlp.gate_up_proj"),
            _g("mlp.gate_up_proj", "mlp.down_proj"),  # the up half: the last rows
        ),
    ),
    "gemma": (
        (
            *MOE_ATTENTION,
            _g("post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj"),
            _g("mlp.up_proj", "mlp.down_proj"),
        ),
    ),
    "gemma2": (GEMMA2_LIKE,),
    "gemma3_text": (GEMMA2_LIKE,),
    "mixtral": (MOE_ATTENTION,),
    "qwen3_moe": (MOE_ATTENTION,),
}
NORM_OFFSETS = {"gemma": 1.0, "gemma2": 1.0, "gemma3_text": 1.0}
# Linears whose outputs include q or k: their error passes through q.k, so no clipping search.
NOT_CLIPPED = ("q_proj", "k_proj", "c_attn", "query_key_value", "Wqkv", "qkv_proj")


def check_awq_family(model_type: str) -> None:
    """Refuse a family without a scaling table, naming it and the ones AWQ runs."""
    if model_type not in FAMILY_GROUPS:
        raise ValueError(
            f"--method awq has no scaling groups for model_type {model_type!r} (families it "
            f"runs: llama, mistral, qwen2, qwen3, {', '.join(FAMILY_GROUPS)}); use --method "
            "gptq or rtn"
        )


def scaling_groups(layer: nn.Module, model_type: str) -> list[ScalingGroup]:
    """The groups of ``layer`` (a transformers decoder layer of ``model_type``), in order."""
    check_awq_family(model_type)
    names = dict(layer.named_modules())
    for alternative in FAMILY_GROUPS[model_type]:
        if all(spec.prev in names and set(spec.linears) <= names.keys() for spec in alternative):
            break
    else:
        raise ValueError(
            f"{type(layer).__name__}: none of the {model_type} module layouts AWQ knows matches "
            f"its modules ({', '.join(n for n in names if n)}); use --method gptq or rtn"
        )
    groups = []
    for spec in alternative:
        prev, linears = names[spec.prev], [names[n] for n in spec.linears]
        if spec.when(layer, prev, linears):
            is_linear = isinstance(prev, nn.Linear) or is_conv1d(prev)
            offset = 0.0 if is_linear else NORM_OFFSETS.get(model_type, 0.0)
            groups.append(ScalingGroup(prev, list(spec.linears), linears, offset))
    return groups


def is_clipped(name: str) -> bool:
    """Whether the clipping search runs for the linear ``name`` (not q, k or fused qkv)."""
    return name.rpartition(".")[2] not in NOT_CLIPPED

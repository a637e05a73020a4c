"""GGUF architectures whose Hugging Face checkpoints are not named like Llama's.

Each family maps llama.cpp's names back to the Hugging Face ones and undoes what
llama.cpp's ``convert_hf_to_gguf.py`` did to the tensors on the way in:

    gpt2       Conv1D weights ([in, out]) transposed to Linear's [out, in]    -> transposed back
    bloom      fused qkv rows [heads, 3, head_dim] regrouped as [3, heads, head_dim]
    gptneox    the same regrouping as bloom
    falcon     fused qkv rows [kv_heads, group + 2, head_dim] regrouped as [q | k | v]
    starcoder  (GPTBigCode), gptj, phi2, mpt: names only

Their Hugging Face configs are built from the GGUF metadata in gguf_family_configs.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import (
    FalconConfig,
    PhiConfig,
    PretrainedConfig,
)

from llmserve.loader.gguf_family_configs import (
    GGUFMeta,
    bloom_config,
    falcon_config,
    gpt2_config,
    gptj_config,
    gptneox_config,
    mpt_config,
    phi2_config,
    starcoder_config,
)
from llmserve.quantization.layout import QuantizedWeight


@dataclass(frozen=True)
class GGUFFamily:
    """How one llama.cpp architecture maps onto a Hugging Face one."""

    hf_architecture: str
    build_config: Callable[[GGUFMeta], PretrainedConfig]
    layer_prefix: str  # Hugging Face layer ``i`` is ``{layer_prefix}.{i}``
    layer_names: dict[str, str]  # GGUF part -> HF module under the layer
    top_names: dict[str, str]  # GGUF tensor base -> HF module
    # (HF name, tensor, config) -> tensor in HF layout
    convert: Callable[[str, torch.Tensor, PretrainedConfig], torch.Tensor] | None = None

    def hf_name(self, layer: str | None, part: str, suffix: str) -> str | None:
        if layer is None:
            module = self.top_names.get(part)
            return None if module is None else f"{module}.{suffix}"
        module = self.layer_names.get(part)
        return None if module is None else f"{self.layer_prefix}.{layer}.{module}.{suffix}"


def regroup_qkv_rows(weight: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``[q | k | v]`` regrouping of a fused qkv weight (or bias) into the
    per-kv-group order of Bloom, GPT-NeoX (``num_kv_heads == num_heads``) and Falcon:
    ``[kv_heads, heads // kv_heads query heads + one key + one value, head_dim]``."""
    head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)
    rest = weight.shape[1:]
    q, k, v = weight.split([num_heads * head_dim] + [num_kv_heads * head_dim] * 2)
    group = num_heads // num_kv_heads
    q = q.reshape(num_kv_heads, group, head_dim, *rest)
    k = k.reshape(num_kv_heads, 1, head_dim, *rest)
    v = v.reshape(num_kv_heads, 1, head_dim, *rest)
    grouped = torch.cat([q, k, v], dim=1)  # [kv_heads, group + 2, head_dim, *rest]
    return grouped.reshape(weight.shape)


def _qkv_per_head(name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    if "query_key_value" not in name:
        return tensor
    heads = config.num_attention_heads
    return regroup_qkv_rows(tensor, heads, heads)


def _falcon_qkv(name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    if "query_key_value" not in name:
        return tensor
    heads = config.num_attention_heads
    if config.new_decoder_architecture:
        kv_heads = config.num_kv_heads
    else:
        kv_heads = 1 if config.multi_query else heads
    return regroup_qkv_rows(tensor, heads, kv_heads)


_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def _gpt2_conv1d(name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    return tensor.t().contiguous() if name.endswith(_CONV1D) else tensor


_GPT2_LAYER = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_GPT2_TOP = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_BLOOM_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}

FAMILIES: dict[str, GGUFFamily] = {
    "gpt2": GGUFFamily(
        "GPT2LMHeadModel", gpt2_config, "transformer.h", _GPT2_LAYER, _GPT2_TOP, _gpt2_conv1d
    ),
    "starcoder": GGUFFamily(
        "GPTBigCodeForCausalLM", starcoder_config, "transformer.h", _GPT2_LAYER, _GPT2_TOP
    ),
    "gptj": GGUFFamily(
        "GPTJForCausalLM",
        gptj_config,
        "transformer.h",
        {
            "attn_norm": "ln_1",
            "attn_q": "attn.q_proj",
            "attn_k": "attn.k_proj",
            "attn_v": "attn.v_proj",
            "attn_output": "attn.out_proj",
            "ffn_up": "mlp.fc_in",
            "ffn_down": "mlp.fc_out",
        },
        {"token_embd": "transformer.wte", "output_norm": "transformer.ln_f", "output": "lm_head"},
    ),
    "bloom": GGUFFamily(
        "BloomForCausalLM",
        bloom_config,
        "transformer.h",
        _BLOOM_LAYER,
        {
            "token_embd": "transformer.word_embeddings",
            "token_embd_norm": "transformer.word_embeddings_layernorm",
            "output_norm": "transformer.ln_f",
            "output": "lm_head",
        },
        _qkv_per_head,
    ),
    "falcon": GGUFFamily(
        "FalconForCausalLM",
        falcon_config,
        "transformer.h",
        {
            **_BLOOM_LAYER,
            # 7B: one norm; 40B: attn_norm is ln_mlp (see family_tensors), attn_norm_2 ln_attn
            "attn_norm": "input_layernorm",
            "attn_norm_2": "ln_attn",
        },
        {
            "token_embd": "transformer.word_embeddings",
            "output_norm": "transformer.ln_f",
            "output": "lm_head",
        },
        _falcon_qkv,
    ),
    "gptneox": GGUFFamily(
        "GPTNeoXForCausalLM",
        gptneox_config,
        "gpt_neox.layers",
        {
            **_BLOOM_LAYER,
            "attn_qkv": "attention.query_key_value",
            "attn_output": "attention.dense",
        },
        {
            "token_embd": "gpt_neox.embed_in",
            "output_norm": "gpt_neox.final_layer_norm",
            "output": "embed_out",
        },
        _qkv_per_head,
    ),
    "phi2": GGUFFamily(
        "PhiForCausalLM",
        phi2_config,
        "model.layers",
        {
            "attn_norm": "input_layernorm",
            "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj",
            "attn_qkv": "self_attn.qkv_proj",  # split into q/k/v by split_phi2_qkv
            "attn_output": "self_attn.dense",
            "ffn_up": "mlp.fc1",
            "ffn_down": "mlp.fc2",
        },
        {
            "token_embd": "model.embed_tokens",
            "output_norm": "model.final_layernorm",
            "output": "lm_head",
        },
    ),
    "mpt": GGUFFamily(
        "MptForCausalLM",
        mpt_config,
        "transformer.blocks",
        {
            "attn_norm": "norm_1",
            "attn_qkv": "attn.Wqkv",
            "attn_output": "attn.out_proj",
            "ffn_norm": "norm_2",
            "ffn_up": "ffn.up_proj",
            "ffn_down": "ffn.down_proj",
        },
        {"token_embd": "transformer.wte", "output_norm": "transformer.norm_f", "output": "lm_head"},
    ),
}


def family_tensors(
    family: GGUFFamily, hf_name: str, tensor: torch.Tensor, config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in HF layout) for one GGUF tensor; Phi-2's fused qkv becomes three."""
    if isinstance(config, FalconConfig) and config.new_decoder_architecture:
        hf_name = hf_name.replace(".input_layernorm.", ".ln_mlp.")
    if family.convert is not None:
        tensor = family.convert(hf_name, tensor, config)
    if isinstance(config, PhiConfig) and ".self_attn.qkv_proj." in hf_name:
        for part, rows in zip("qkv", tensor.chunk(3)):  # llama.cpp's phi2 is multi-head only
            yield hf_name.replace(".qkv_proj.", f".{part}_proj."), rows.contiguous()
        return
    yield hf_name, tensor


def family_quantized(
    family: GGUFFamily, hf_name: str, weight: QuantizedWeight, config: PretrainedConfig
) -> Iterator[tuple[str, QuantizedWeight]]:
    """``family_tensors`` for a quantized matrix: its rows moved as the float tensor's would
    be, but kept ``[out, in]`` (a GPT-2 Conv1D is not transposed back; quantized layers of
    every format hold it as a Linear)."""
    rows = torch.arange(weight.shape[0])
    for name, order in family_tensors(family, hf_name, rows, config):  # 1-D: rows only
        yield name, weight if torch.equal(order, rows) else weight.select_rows(order)

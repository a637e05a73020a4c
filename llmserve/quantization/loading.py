"""Put quantized linear layers into a loaded (or loading) model.

Two routes, chosen by the method:

    run-time methods (int8, llm_int8, nf4, fp4):  load the float checkpoint as usual, then swap
        every ``nn.Linear`` but the LM head and the MoE routers for its quantized form
        (gpt-fast's module swap); stacked experts are unstacked into one linear each first
    checkpoint methods (gguf, gptq, awq):  the checkpoint's linear weights are already
        quantized; each is converted to the internal layout (``layout.py``), the parts of a
        fused projection (q/k/v, gate/up) gathered, and the module swapped; every other tensor
        (norms, embeddings, a float LM head) goes through the model's own ``load_weights``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from llmserve.layers.moe import SparseMoE, expert_layer_name
from llmserve.quantization.layout import QuantizedWeight
from llmserve.quantization.linear import QuantEmbedding, QuantLinear
from llmserve.quantization.llm_int8 import LLMInt8Linear

RUNTIME_METHODS = ("int8", "llm_int8", "nf4", "fp4")
CHECKPOINT_METHODS = ("gguf", "gptq", "awq")
EMBEDDING = "embed_tokens.weight"  # our name of the token table, every family


def quantize_linear(linear: nn.Linear, method: str, options: dict, kernel: str):
    """The quantized replacement of one float ``nn.Linear``."""
    weight = linear.weight.detach().float()
    bias = None if linear.bias is None else linear.bias.detach().clone()
    if method == "llm_int8":
        return LLMInt8Linear(weight, bias, threshold=options["llm_int8_threshold"])
    if method == "int8":
        from llmserve.quantization.int8 import quantize_int8

        qweight = quantize_int8(weight)
    else:
        from llmserve.quantization.bnb_4bit import quantize_4bit, to_internal

        packed = quantize_4bit(
            weight, method, blocksize=64, compress_statistics=options["nf4_double_quant"]
        )
        qweight = to_internal(packed)
    return QuantLinear([qweight], bias, kernel=kernel, method=method)


def check_runtime_shapes(model: nn.Module, method: str) -> None:
    """Refuse, before any work, a layer whose input size the method cannot group."""
    multiple = 64 if method in ("nf4", "fp4") else 32
    for name, module in model.named_modules():
        sizes = []
        if isinstance(module, nn.Linear) and name != "lm_head":
            sizes = [(name, module.in_features)]
        elif isinstance(module, SparseMoE) and module.experts13 is None:
            sizes = [(f"{name}.w13", module.w13.shape[2]), (f"{name}.w2", module.w2.shape[2])]
        for layer, in_features in sizes:
            if in_features % multiple:
                raise ValueError(
                    f"--quantization {method} needs in_features divisible by {multiple}; "
                    f"layer {layer} has {in_features}"
                )


def quantize_model(model: nn.Module, method: str, options: dict, kernel: str) -> int:
    """Swap every ``nn.Linear`` except the LM head and the MoE routers (every expert
    included) for ``method``'s layer; returns how many."""
    keep = {"lm_head"}
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            module.unstack_experts()
            keep.add(f"{name}.gate")  # the router: which experts run stays exact
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name not in keep
    ]
    for name, linear in targets:
        model.set_submodule(name, quantize_linear(linear, method, options, kernel))
    return len(targets)


def install_quantized_weights(
    model: nn.Module,
    quantized: dict[str, QuantizedWeight],
    biases: dict[str, torch.Tensor],
    kernel: str,
    method: str,
    device: torch.device,
) -> None:
    """Swap the model's linear layers for ``QuantLinear`` s built from checkpoint weights.

    ``quantized``: Hugging Face weight name (``model.layers.0.self_attn.q_proj.weight``,
    ``transformer.h.0.attn.c_attn.weight``) -> its quantized weight ``[out, in]`` in HF row
    order (a GPT-2 Conv1D's too); ``biases``: HF bias name -> tensor, for those layers. The
    model's ``quantized_placement`` says where each goes (its own checkpoint-name mapping).
    """
    fused: dict[str, dict[int | None, QuantizedWeight]] = defaultdict(dict)
    fused_bias: dict[str, dict[int | None, torch.Tensor]] = defaultdict(dict)
    embedding = None
    for hf_name, weight in quantized.items():
        target, shard, order = model.quantized_placement(hf_name, weight.shape[0])
        if target is None:
            continue
        weight = weight if order is None else weight.select_rows(order)
        weight = _cut_for_rank(model, hf_name, weight)
        if target == EMBEDDING:
            embedding = weight
            continue
        module_name = target.removesuffix(".weight")
        moe_name = expert_layer_name(module_name)
        if moe_name is not None:  # a quantized expert: that layer's experts go one by one
            model.get_submodule(moe_name).unstack_experts()
        _check_linear(model, module_name, hf_name)
        fused[module_name][shard] = weight.to(device)
        bias_name = hf_name.removesuffix(".weight") + ".bias"
        bias = biases.get(bias_name)
        if bias is not None:
            bias = bias if order is None else bias[order]
            fused_bias[module_name][shard] = _cut_for_rank(model, bias_name, bias)
    for module_name, parts_by_shard in fused.items():
        linear = model.get_submodule(module_name)
        parts = _in_shard_order(module_name, parts_by_shard, model)
        bias_parts = fused_bias.get(module_name)
        bias = None
        if bias_parts:
            bias = torch.cat([bias_parts[s] for s in sorted(bias_parts, key=_shard_key)])
            bias = bias.float().to(device)
        if sum(p.shape[0] for p in parts) != linear.out_features:
            raise ValueError(f"{module_name}: quantized rows do not match the model's layer")
        model.set_submodule(module_name, QuantLinear(parts, bias, kernel=kernel, method=method))
    _check_all_experts_quantized(model)
    if embedding is not None:  # last: a tied LM head then multiplies by the same blocks
        _install_embedding(model, embedding.to(device), kernel, method)


def _cut_for_rank(model: nn.Module, hf_name: str, tensor):
    """A tensor-parallel rank's share of a decoder.py family's weight (the Llama family's
    arrive cut already); the tensor itself otherwise."""
    cut = getattr(model, "cut_for_rank", None)
    return tensor if cut is None else cut(hf_name, tensor)


def _check_linear(model: nn.Module, module_name: str, hf_name: str) -> None:
    if not isinstance(model.get_submodule(module_name), nn.Linear):
        raise ValueError(
            f"{hf_name} is quantized in the checkpoint, but {type(model).__name__}.{module_name} "
            "is not a linear layer; llmserve computes on quantized linear weights only"
        )


def _check_all_experts_quantized(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE) and module.experts13 is not None:
            left = [
                f"{name}.{which}.{i}"
                for which in ("experts13", "experts2")
                for i, layer in enumerate(getattr(module, which))
                if isinstance(layer, nn.Linear)
            ]
            if left:
                raise ValueError(
                    f"the checkpoint quantizes only some experts of {name} ({left[:4]} are "
                    "float); llmserve needs all of a layer's experts quantized or none"
                )


def _shard_key(shard: int | None) -> int:
    return -1 if shard is None else shard


def _in_shard_order(module_name, parts_by_shard, model) -> list[QuantizedWeight]:
    shards = sorted(parts_by_shard, key=_shard_key)
    expected = [None] if shards == [None] else list(range(len(model.shard_sizes(module_name))))
    if shards != expected:
        raise ValueError(
            f"{module_name}: the checkpoint quantizes only some of its fused parts "
            f"(shards {shards} of {expected}); llmserve needs all or none"
        )
    return [parts_by_shard[s] for s in shards]


def _install_embedding(model, weight: QuantizedWeight, kernel: str, method: str) -> None:
    """A quantized token table stays quantized; a tied LM head multiplies by the same blocks."""
    dtype = next(p for p in model.parameters()).dtype
    model.embed_tokens = QuantEmbedding(weight, dtype)
    if model.tie_word_embeddings:
        model.lm_head = QuantLinear([weight], None, kernel=kernel, method=method)


def set_output_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """A quantized embedding returns the model's activation dtype (set after ``model.to``)."""
    for module in model.modules():
        if isinstance(module, QuantEmbedding):
            module.dtype = dtype


def iter_quantized_checkpoint(resolved, method: str):
    """(HF name, ``QuantizedWeight`` or float tensor) for every tensor of a quantized checkpoint."""
    if method == "gguf":
        from llmserve.loader.gguf_loader import iter_gguf_quantized

        return iter_gguf_quantized(resolved.weights_path)
    from llmserve.quantization.checkpoint_config import read_checkpoint_quantization
    from llmserve.quantization.hf_checkpoint import iter_gptq_awq

    return iter_gptq_awq(resolved.path, read_checkpoint_quantization(resolved.path))


def split_quantized(
    tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """(quantized weights, all biases, the other float tensors) from a mixed stream."""
    quantized: dict[str, QuantizedWeight] = {}
    floats: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors:
        if isinstance(tensor, QuantizedWeight):
            quantized[name] = tensor
        else:
            floats.append((name, tensor))
    quantized_prefixes = {n.removesuffix(".weight") for n in quantized}
    biases = {n: t for n, t in floats if n.removesuffix(".bias") in quantized_prefixes}
    floats = [(n, t) for n, t in floats if n not in biases]
    return quantized, biases, floats


def graph_capturable(model: nn.Module) -> bool:
    """False when a layer's forward depends on its input's values (LLM.int8 outliers), so a
    captured CUDA graph would replay the wrong shapes."""
    return all(getattr(m, "graph_capturable", True) for m in model.modules())


def weight_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Resident weight bytes by storage type: float parameters by dtype, quantized values as
    int4 / int8 and their scales (and mins) as "scales"."""
    totals: dict[str, int] = defaultdict(int)
    seen: set[int] = set()

    def add(key: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            totals[key] += tensor.numel() * tensor.element_size()

    for param in model.parameters():
        add(str(param.dtype).removeprefix("torch."), param)
    for module in model.modules():
        weights = list(getattr(module, "parts", []))
        if isinstance(module, QuantEmbedding):
            weights.append(module.weight_q)
        for w in weights:
            add(f"int{w.bits}", w.qweight)
            for t in (w.scales, w.mins, w.lut, w.perm):
                add("scales", t)
        if isinstance(module, QuantLinear | LLMInt8Linear):  # bias; LLM.int8's CB and SCB
            for buffer in module.buffers(recurse=False):
                add(str(buffer.dtype).removeprefix("torch."), buffer)
        # a float layer packed for oneDNN or llmserve's GEMM, and its second copy packed for
        # llmserve's GEMM at decode sizes (PackedLinear on Zen 4)
        for attr in ("packed_weight", "f32_weight", "bf16_weight"):
            packed = getattr(module, attr, None)
            if isinstance(packed, torch.Tensor):
                add(str(packed.dtype).removeprefix("torch."), packed)
    return dict(totals)


def describe_quantization(model: nn.Module) -> str:
    """The methods and kernels of the model's quantized layers, for the start-up log."""
    found = {
        f"{getattr(m, 'method', 'llm_int8')}, {getattr(m, 'kernel', 'torch')} kernel"
        for m in model.modules()
        if isinstance(m, QuantLinear | LLMInt8Linear)
    }
    return "".join(f"quantization {q}; " for q in sorted(found))


def describe_weight_bytes(totals: dict[str, int]) -> str:
    total = sum(totals.values())
    parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(totals.items()))
    return f"weights {total / 2**20:.1f} MiB ({parts})"


def resolve_quantization(
    requested: str | None, resolved, device: torch.device, dtype
) -> str | None:
    """The method to apply (``requested``, or the one a GPTQ/AWQ checkpoint declares), after
    refusing every combination that cannot work; runs before anything is loaded."""
    declared = None
    if resolved.kind == "hf":
        from llmserve.quantization.checkpoint_config import read_checkpoint_quantization

        spec = read_checkpoint_quantization(resolved.path)
        declared = None if spec is None else spec.method
    method = requested or declared
    if method is None:
        return None
    if declared and requested and requested != declared:
        raise ValueError(
            f"{resolved.display_name} is a {declared.upper()} checkpoint; --quantization "
            f"{requested} cannot apply to it (omit --quantization, or pass {declared})"
        )
    if method in ("gptq", "awq") and declared != method:
        raise ValueError(
            f"--quantization {method} needs a {method.upper()} checkpoint (a Hugging Face "
            f"directory whose config.json has a quantization_config with quant_method "
            f"{method!r}, and {method.upper()} tensors); {resolved.display_name} has none"
        )
    if method == "gguf":
        if resolved.kind != "gguf":
            raise ValueError(
                f"--quantization gguf computes on a GGUF file's blocks; {resolved.display_name} "
                "is not a GGUF file"
            )
        from llmserve.loader.gguf_loader import check_gguf_quantized_types

        check_gguf_quantized_types(resolved.weights_path)
    if device.type == "cpu" and dtype != torch.float32:
        raise ValueError(
            f"--quantization {method} on CPU computes in float32; --dtype "
            f"{str(dtype).removeprefix('torch.')} conflicts with it (use --dtype auto or float32)"
        )
    return method

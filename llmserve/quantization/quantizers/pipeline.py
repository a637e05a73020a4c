"""``quantize()``: checks, calibration, the layer-by-layer loop, and the checkpoint.

check options, output dir, architecture, every layer's shape, the calibration text
load the float model (HF directory or GGUF, float32)
other families than Llama-shaped ones: rtn as below; gptq by replay (replay.py); awq by
    calling each transformers decoder layer with its captured arguments (awq_replay.py)
h = embed(calibration tokens)                                 [S, T, hidden]
for each decoder layer (progress bar with ETA):
    rtn:  round every linear                                   (no calibration)
    gptq: q/k/v, o, gate/up, down in turn, each from the outputs of the ones before,
          quantized; h = the layer's output with its quantized weights
    awq:  scale search, fold, clip, round; h = the layer's float output
pack (GPTQ v1 or AWQ gemm) and write the directory atomically
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from llmserve.quantization.quantizers import awq, checkpoint_writer
from llmserve.quantization.quantizers.awq_groups import check_awq_family
from llmserve.quantization.quantizers.awq_replay import awq_by_replay
from llmserve.quantization.quantizers.calibration import calibration_tokens
from llmserve.quantization.quantizers.config import QuantizeOptions, check_options
from llmserve.quantization.quantizers.decoder_stages import (
    LINEAR_GROUPS,
    DecoderStages,
    rotary_tables,
)
from llmserve.quantization.quantizers.gptq import HessianAccumulator, gptq_quantize
from llmserve.quantization.quantizers.replay import gptq_by_replay
from llmserve.quantization.quantizers.rtn import QuantResult, quantize_rtn
from llmserve.quantization.quantizers.source_model import (
    CALIBRATED_MODEL_TYPES,
    checkpoint_names,
    decoder_layers,
    empty_model,
    generation_config,
    is_conv1d,
    linear_layers,
    linear_weight,
    load_float_model,
)


@dataclass(frozen=True)
class QuantizeReport:
    """What ``quantize`` wrote and what it cost."""

    output: str
    method: str
    bits: int
    group_size: int
    num_layers: int
    """Linear layers quantized."""
    num_samples: int
    """Calibration sequences used (0 for rtn)."""
    seq_len: int
    seconds: float
    """Wall time from loading the model to the renamed directory."""
    peak_memory_bytes: int
    """Peak resident memory of this process so far."""


def quantize(model: str | None = None, output: str | None = None, **options) -> QuantizeReport:
    """Quantize ``model`` (HF directory, GGUF file, or None for the default model) into the
    Hugging Face directory ``output``; keywords are ``QuantizeOptions`` fields, e.g.
    ``quantize("m.gguf", "out", method="gptq", bits=4, group_size=128, desc_act=True)``."""
    opts = QuantizeOptions(model=model, output=output, **options)
    check_options(opts)
    from llmserve.loader import load_config, resolve_model
    from llmserve.models.registry import get_model_class
    from llmserve.tokenizer import get_tokenizer

    resolved = resolve_model(opts.model)
    hf_config = load_config(resolved)
    get_model_class(hf_config)  # an architecture llmserve runs
    check_calibrated_architecture(hf_config, opts.method)
    check_layer_shapes(linear_layers(empty_model(hf_config)), opts)
    tokenizer = get_tokenizer(resolved)
    tokens = None
    if opts.needs_calibration:
        tokens = calibration_tokens(tokenizer, opts.calibration, opts.num_samples, opts.seq_len)
    start = time.perf_counter()
    float_model = load_float_model(resolved, hf_config)
    results = quantize_layers(float_model, tokens, opts)
    tensors = checkpoint_tensors(float_model, results, opts)
    checkpoint_writer.write_checkpoint(
        opts.output,
        tensors,
        hf_config,
        quantization_config(opts, tokens),
        tokenizer,
        generation_config(resolved, hf_config),
        opts.overwrite,
    )
    return QuantizeReport(
        output=opts.output,
        method=opts.method,
        bits=opts.bits,
        group_size=opts.group_size,
        num_layers=len(results),
        num_samples=0 if tokens is None else tokens.shape[0],
        seq_len=opts.seq_len,
        seconds=time.perf_counter() - start,
        peak_memory_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def check_calibrated_architecture(hf_config, method: str) -> None:
    """awq folds its scales into the module before each group of linears, which
    ``awq_groups.py`` names per family: refuse a family it has no table for."""
    if method == "awq" and hf_config.model_type not in CALIBRATED_MODEL_TYPES:
        check_awq_family(hf_config.model_type)


def check_layer_shapes(linears: dict, opts: QuantizeOptions) -> None:
    """Refuse a layer the group size or the packing cannot divide, naming it."""
    g = opts.group_size
    shapes = {name: linear_weight(linear).shape for name, linear in linears.items()}
    common = math.gcd(*(k for _, k in shapes.values()))
    fitting = [str(s) for s in range(32, common + 1, 32) if common % s == 0]
    for name, (n, k) in shapes.items():
        if k % 32:
            raise ValueError(
                f"layer {name} has in_features {k}, not a multiple of 32 (the quantized layout "
                "packs blocks of 32 input columns); this model cannot be quantized"
            )
        if g != -1 and k % g:
            raise ValueError(
                f"layer {name} has in_features {k}, not divisible by --group-size {g}; allowed "
                f"for this model: -1 or {', '.join(fitting) or 'none'}"
            )
        rows = 8 if opts.method == "awq" else 32 // math.gcd(opts.bits, 32)
        if n % rows:
            raise ValueError(
                f"layer {name} has out_features {n}, not a multiple of {rows} as {opts.bits}-bit "
                f"{'AWQ' if opts.method == 'awq' else 'GPTQ'} zero points need"
            )


def quantize_layers(model, tokens: torch.Tensor | None, opts: QuantizeOptions) -> dict:
    """Checkpoint prefix -> ``QuantResult`` for every decoder linear layer, in layer order."""
    if model.config.model_type not in CALIBRATED_MODEL_TYPES:
        if opts.method == "gptq":
            return gptq_by_replay(model, tokens, opts)
        if opts.method == "awq":
            return awq_by_replay(model, tokens, opts)
    layers_prefix, layers = decoder_layers(model)
    results: dict[str, QuantResult] = {}
    h = cos = sin = None
    if tokens is not None:
        with torch.no_grad():
            h = model.model.embed_tokens(tokens)  # [S, T, hidden]
        cos, sin = rotary_tables(model, tokens.shape[1])
    bar = tqdm(layers, desc=f"{opts.method} {opts.bits}-bit", unit="layer")
    for index, layer in enumerate(bar):
        prefix = f"{layers_prefix}.{index}."
        if opts.method == "rtn":
            found = _rtn_layer(layer, opts)
        elif opts.method == "gptq":
            h, found = _gptq_layer(DecoderStages(layer, cos, sin), h, opts)
        else:
            h, found = awq.awq_layer(
                DecoderStages(layer, cos, sin), h, opts.group_size, opts.awq_search_samples
            )
        results.update({prefix + name: result for name, result in found.items()})
    return results


def _rtn_layer(layer, opts: QuantizeOptions) -> dict[str, QuantResult]:
    """Every linear layer of any family's decoder layer, rounded (no calibration)."""
    return {
        name: quantize_rtn(
            linear_weight(linear), opts.bits, opts.group_size, opts.is_symmetric, mse=opts.mse
        )
        for name, linear in linear_layers_of(layer).items()
    }


def linear_layers_of(layer) -> dict:
    """Name under ``layer`` -> each ``nn.Linear`` or Conv1D in it."""
    return {
        name: module
        for name, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear) or is_conv1d(module)
    }


def _gptq_layer(stages: DecoderStages, h: torch.Tensor, opts: QuantizeOptions):
    """True-sequential GPTQ of one layer; returns (its output with quantized weights, results)."""
    results: dict[str, QuantResult] = {}
    x_attn = stages.attention_input(h)
    results.update(_gptq_group(stages.layer, LINEAR_GROUPS[0], x_attn, opts))
    heads = stages.attention_heads(x_attn)
    del x_attn
    results.update(_gptq_group(stages.layer, LINEAR_GROUPS[1], heads, opts))
    h2, x_mlp = stages.mlp_input(h, heads)
    del heads
    results.update(_gptq_group(stages.layer, LINEAR_GROUPS[2], x_mlp, opts))
    hidden = stages.mlp_hidden(x_mlp)
    del x_mlp
    results.update(_gptq_group(stages.layer, LINEAR_GROUPS[3], hidden, opts))
    return stages.layer_output(h2, hidden), results


def _gptq_group(layer, names, inputs: torch.Tensor, opts: QuantizeOptions):
    """GPTQ of the linears in ``names`` (one shared input, so one Hessian, stacked rows); each
    weight is replaced by its quantized value for the stages after it."""
    linears = [layer.get_submodule(name) for name in names]
    accumulator = HessianAccumulator(inputs.shape[-1])
    accumulator.add(inputs)
    result = gptq_quantize(
        torch.cat([linear.weight.data for linear in linears]),  # [sum N, K]
        accumulator.hessian(),
        bits=opts.bits,
        group_size=opts.group_size,
        sym=opts.is_symmetric,
        desc_act=opts.desc_act,
        damp_percent=opts.damp_percent,
        block_size=opts.block_size,
        mse=opts.mse,
    )
    found, start = {}, 0
    for name, linear in zip(names, linears):
        rows = slice(start, start + linear.out_features)
        start += linear.out_features
        part = QuantResult(
            result.codes[rows], result.zeros[rows], result.scales[rows], result.g_idx, opts.bits
        )
        linear.weight.data = part.dequantize()
        found[name] = part
    return found


def checkpoint_tensors(model, results: dict[str, QuantResult], opts: QuantizeOptions) -> dict:
    """Every tensor of the output checkpoint: packed layers, everything else fp16."""
    pack = checkpoint_writer.awq_tensors if opts.method == "awq" else checkpoint_writer.gptq_tensors
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.removesuffix(".weight") in results or (tied and name == "lm_head.weight"):
            continue
        tensors[name] = tensor.detach().half().contiguous()
    tensors = checkpoint_names(model, tensors)
    for prefix, result in results.items():
        tensors.update({f"{prefix}.{key}": value for key, value in pack(result).items()})
    return tensors


def quantization_config(opts: QuantizeOptions, tokens: torch.Tensor | None) -> dict:
    """config.json's ``quantization_config``, as transformers / AutoGPTQ / AutoAWQ write it."""
    from llmserve import __version__

    meta = {"quantizer": [f"llmserve:{__version__}"], "method": opts.method}
    if tokens is not None:
        meta.update(calibration=opts.calibration, num_samples=tokens.shape[0])
        meta["seq_len"] = tokens.shape[1]
    if opts.method == "awq":
        return {
            "quant_method": "awq",
            "bits": opts.bits,
            "group_size": opts.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
            "meta": meta,
        }
    return {
        "quant_method": "gptq",
        "bits": opts.bits,
        "group_size": opts.group_size,
        "desc_act": opts.desc_act,
        "sym": opts.is_symmetric,
        "damp_percent": opts.damp_percent,
        "true_sequential": True,
        "static_groups": False,
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "lm_head": False,
        "meta": meta,
    }

"""GPTQ for any family: the inputs of decoder layer i's linear layers are caught by running the
transformers model itself (its own positions, masks, ALiBi, soft-capping) over the calibration
sequences, stopped right after layer i, with layers 0..i-1 already holding their quantized
weights:

    for layer i:  hooks on its linears add their inputs to one Hessian each
                  model(tokens) ... layer i -> stop
                  GPTQ each linear from its Hessian; the weight becomes its quantized value

Layer-sequential, not true-sequential inside a layer (q/k/v, o, up, down all see the layer's
float inputs, AutoGPTQ's ``true_sequential=False``), and O(layers^2) layer passes in all: the
generic path where ``decoder_stages.py`` (Llama-shaped layers, one pass) does not apply.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from llmserve.quantization.quantizers.config import QuantizeOptions
from llmserve.quantization.quantizers.decoder_stages import CHUNK
from llmserve.quantization.quantizers.gptq import HessianAccumulator, gptq_quantize
from llmserve.quantization.quantizers.rtn import QuantResult
from llmserve.quantization.quantizers.source_model import (
    decoder_layers,
    is_conv1d,
    linear_weight,
)


class Stop(Exception):
    """Raised by a hook once nothing past its layer needs computing."""


def gptq_by_replay(
    model: nn.Module, tokens: torch.Tensor, opts: QuantizeOptions
) -> dict[str, QuantResult]:
    """Checkpoint prefix -> ``QuantResult`` of every linear in the decoder layers, in order."""
    prefix, layers = decoder_layers(model)
    results: dict[str, QuantResult] = {}
    for index, layer in enumerate(tqdm(layers, desc=f"gptq {opts.bits}-bit", unit="layer")):
        linears = {
            name: module
            for name, module in layer.named_modules()
            if isinstance(module, nn.Linear) or is_conv1d(module)
        }
        hessians = _layer_hessians(model, layer, linears, tokens)
        for name, linear in linears.items():
            result = gptq_quantize(
                linear_weight(linear),
                hessians[name].hessian(),
                bits=opts.bits,
                group_size=opts.group_size,
                sym=opts.is_symmetric,
                desc_act=opts.desc_act,
                damp_percent=opts.damp_percent,
                block_size=opts.block_size,
            )
            dequantized = result.dequantize()  # [N, K]
            linear.weight.data = dequantized.T.contiguous() if is_conv1d(linear) else dequantized
            results[f"{prefix}.{index}.{name}"] = result
    return results


def _layer_hessians(
    model: nn.Module, layer: nn.Module, linears: dict[str, nn.Module], tokens: torch.Tensor
) -> dict[str, HessianAccumulator]:
    hessians = {name: HessianAccumulator(linear_weight(m).shape[1]) for name, m in linears.items()}

    def catch(accumulator: HessianAccumulator):
        return lambda module, args: accumulator.add(args[0].detach())

    def stop(module, args, output):
        raise Stop

    handles = [m.register_forward_pre_hook(catch(hessians[n])) for n, m in linears.items()]
    handles.append(layer.register_forward_hook(stop))
    run_with_hooks(model, tokens.split(CHUNK), handles)
    return hessians


def run_with_hooks(model: nn.Module, chunks, handles: list) -> None:
    """``model`` over each chunk of token ids ``[<= CHUNK, T]`` (a hook may end a pass early
    by raising ``Stop``), then the hooks removed."""
    try:
        with torch.no_grad():
            for chunk in chunks:
                try:
                    model(input_ids=chunk, use_cache=False)
                except Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()

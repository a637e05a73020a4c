"""AWQ for any family: the transformers decoder layers themselves are called, with the
arguments the model passes them (positions, masks, rotary tables, ALiBi, Gemma 3's sliding or
global layer type), caught once by forward pre-hooks:

    model(tokens) with a pre-hook on every layer (kwargs too) -> layer 0's hidden states and
                  each layer's other arguments, per chunk of sequences; stop before layer L-1
    for layer i:  layer(h) over every chunk, hooks on its linears -> each linear's input x,
                  and the layer's float output (the next layer's h, as AutoAWQ and awq.py)
                  for each scaling group (awq_groups.py): the alpha search (awq.best_scale),
                  scored by the whole layer's output on the first ``awq_search_samples``
                  sequences (their own leading chunks), with the group's linears Q(W*s)/s
                  fold every group's scale, then clip (not q/k/qkv) and round each linear

One model pass and one layer pass per layer (not replay.py's pass up to each layer): a layer's
arguments other than its hidden states depend only on the tokens. The Llama-shaped families
keep ``awq.py``'s stage-by-stage path (sub-block scoring), whose results are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from llmserve.quantization.quantizers.awq import (
    best_scale,
    clip_weight,
    fold_scale,
    mean_abs,
    set_weight,
)
from llmserve.quantization.quantizers.awq_groups import is_clipped, scaling_groups
from llmserve.quantization.quantizers.config import QuantizeOptions
from llmserve.quantization.quantizers.decoder_stages import CHUNK
from llmserve.quantization.quantizers.replay import Stop, run_with_hooks
from llmserve.quantization.quantizers.rtn import QuantResult, quantize_rtn
from llmserve.quantization.quantizers.source_model import (
    decoder_layers,
    is_conv1d,
    linear_weight,
)


@dataclass
class LayerCall:
    """How the model called a decoder layer for one chunk, its hidden states left out."""

    args: tuple
    kwargs: dict
    is_positional: bool
    """The hidden states came first in ``args`` (else as the ``hidden_states`` keyword)."""

    def __call__(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """``layer``'s output hidden states ``[c, T, hidden]`` for input ``h``."""
        if self.is_positional:
            out = layer(h, *self.args, **self.kwargs)
        else:
            out = layer(*self.args, hidden_states=h, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


def awq_by_replay(
    model: nn.Module, tokens: torch.Tensor, opts: QuantizeOptions
) -> dict[str, QuantResult]:
    """Checkpoint prefix -> ``QuantResult`` of every linear in the decoder layers, in order;
    the model keeps its folded (float, function-preserving) norms and biases."""
    prefix, layers = decoder_layers(model)
    num_search = min(opts.awq_search_samples, tokens.shape[0])
    chunks = [*tokens[:num_search].split(CHUNK), *tokens[num_search:].split(CHUNK)]
    hidden, calls = capture_layer_calls(model, layers, chunks)
    search_chunks = math.ceil(num_search / CHUNK)
    model_type = model.config.model_type
    results: dict[str, QuantResult] = {}
    for index, layer in enumerate(tqdm(layers, desc="awq 4-bit", unit="layer")):
        hidden, found = awq_layer_by_replay(
            layer, model_type, calls[index], hidden, opts.group_size, search_chunks
        )
        results.update({f"{prefix}.{index}.{name}": result for name, result in found.items()})
    return results


def capture_layer_calls(
    model: nn.Module, layers: nn.ModuleList, chunks: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[list[LayerCall]]]:
    """(layer 0's input hidden states per chunk, every layer's ``LayerCall`` per chunk)."""
    hidden: list[torch.Tensor] = []
    calls: list[list[LayerCall]] = [[] for _ in layers]

    def catch(index: int):
        def hook(module, args, kwargs):
            kwargs = dict(kwargs)
            h = args[0] if args else kwargs.pop("hidden_states")
            calls[index].append(LayerCall(args[1:] if args else args, kwargs, bool(args)))
            if index == 0:
                hidden.append(h.detach().clone())  # [c, T, hidden]
            if index == len(layers) - 1:
                raise Stop

        return hook

    handles = [
        layer.register_forward_pre_hook(catch(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    run_with_hooks(model, chunks, handles)
    return hidden, calls


def layer_outputs(
    layer: nn.Module, calls: list[LayerCall], hidden: list[torch.Tensor]
) -> torch.Tensor:
    """The layer's output ``[S, T, hidden]`` over the chunks (its current weights)."""
    with torch.no_grad():
        return torch.cat([call(layer, h) for call, h in zip(calls, hidden)])


def awq_layer_by_replay(
    layer: nn.Module,
    model_type: str,
    calls: list[LayerCall],
    hidden: list[torch.Tensor],
    group_size: int,
    search_chunks: int,
) -> tuple[list[torch.Tensor], dict[str, QuantResult]]:
    """Scale, clip and quantize ``layer``'s linears; returns (its float output per chunk,
    name under the layer -> quantized weight)."""
    inputs, outputs = _linear_inputs(layer, calls, hidden)
    groups = scaling_groups(layer, model_type)

    def run() -> torch.Tensor:
        return layer_outputs(layer, calls[:search_chunks], hidden[:search_chunks])

    found = [
        best_scale(mean_abs(inputs[group.names[0]]), group.linears, run, group_size)
        for group in groups
    ]
    divisors: dict[str, torch.Tensor] = {}
    for group, scales in zip(groups, found):
        fold_scale(group.prev, group.linears, scales, group.norm_offset)
        divisors.update(dict.fromkeys(group.names, scales))
    results = {}
    for name, linear in _linears(layer).items():
        if is_clipped(name) and name in inputs:
            x = inputs[name] / divisors[name] if name in divisors else inputs[name]
            set_weight(linear, clip_weight(linear_weight(linear), x, group_size))
        results[name] = quantize_rtn(linear_weight(linear), 4, group_size, sym=False, style="awq")
    return outputs, results


def _linears(layer: nn.Module) -> dict[str, nn.Module]:
    return {
        name: module
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear) or is_conv1d(module)
    }


def _linear_inputs(
    layer: nn.Module, calls: list[LayerCall], hidden: list[torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """(linear name -> its input ``[S, T, K]`` over all chunks, the layer's output per chunk);
    linears reading the same tensor (q, k, v) share one concatenation."""
    caught: dict[str, list[torch.Tensor]] = {name: [] for name in _linears(layer)}

    def catch(name: str):
        return lambda module, args: caught[name].append(args[0].detach())

    handles = [m.register_forward_pre_hook(catch(n)) for n, m in _linears(layer).items()]
    try:
        with torch.no_grad():
            outputs = [call(layer, h) for call, h in zip(calls, hidden)]  # [c, T, hidden] each
    finally:
        for handle in handles:
            handle.remove()
    shared: dict[tuple[int, ...], torch.Tensor] = {}
    inputs = {}
    for name, parts in caught.items():
        if not parts:  # never reached (an expert no token was routed to): no clipping
            continue
        key = tuple(id(t) for t in parts)
        if key not in shared:
            shared[key] = torch.cat(parts)
        inputs[name] = shared[key]
    return inputs, outputs

"""AWQ (Lin et al. 2023) of one decoder layer: protect the salient input channels (those with
large activations) by scaling them up before quantization, then clip the weight range.

For each group of linear layers sharing an input x (q/k/v, gate/up, down; o_proj only when
it has as many inputs as v_proj has outputs, i.e. no grouped-query attention):

    s(alpha) = mean|x|^alpha per input channel, normalized by sqrt(max(s) * min(s))
    alpha*   = argmin over alpha in {0, 0.05, ..., 1} of || block(x; Q(W * s) / s) - block(x; W) ||^2
    fold:      W <- W * s, and the preceding op's output divided by s (the RMSNorm weight, or
               the rows of the previous linear: v_proj for o_proj, up_proj for down_proj)

``block`` is the whole attention block for q/k/v, the MLP for gate/up, the layer itself
otherwise; its error is scored on the first ``awq_search_samples`` calibration sequences
(mean|x| uses all of them). Then for every layer but q/k (their error passes through the
q.k product) the clipping search: per output row and group, the largest |w| kept is
``max|w| * (1 - i / 20)``, i = 0..9, whichever gives the least output error on 512 tokens.
Finally each weight is quantized round-to-nearest, asymmetric (AutoAWQ's grid). As in AutoAWQ,
the next layer's inputs are this layer's float outputs.

``awq_layer`` is the Llama-shaped path (``decoder_stages.py``); the search, fold and clip
helpers (``best_scale``, ``fold_scale``: linears and Conv1D, RMSNorm, LayerNorm with its bias,
Gemma's 1 + w; ``clip_weight``) serve ``awq_replay.py``, the path of every other family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmserve.quantization.quantizers.decoder_stages import DecoderStages, chunked
from llmserve.quantization.quantizers.rtn import (
    QuantResult,
    group_params,
    quantize_rtn,
    quantize_values,
)
from llmserve.quantization.quantizers.source_model import is_conv1d, linear_weight

NUM_ALPHAS = 20  # alpha = 0, 1/20, ..., 1
CLIP_GRID, CLIP_MAX_SHRINK, CLIP_TOKENS = 20, 0.5, 512
NOT_CLIPPED = ("self_attn.q_proj", "self_attn.k_proj")


def awq_layer(
    stages: DecoderStages, h: torch.Tensor, group_size: int, num_search: int
) -> tuple[torch.Tensor, dict[str, QuantResult]]:
    """Scale, clip and quantize ``stages.layer``'s linears; returns (the layer's float output
    for ``h``, module name -> its quantized weight)."""
    layer = stages.layer
    attn, mlp = layer.self_attn, layer.mlp
    x_attn = stages.attention_input(h)  # [S, T, hidden]
    heads = stages.attention_heads(x_attn)  # [S, T, heads * hd]
    h2, x_mlp = stages.mlp_input(h, heads)
    hidden = stages.mlp_hidden(x_mlp)  # [S, T, intermediate]
    out = stages.layer_output(h2, hidden)
    del h2
    inputs = {"self_attn.q_proj": x_attn, "self_attn.o_proj": heads}
    inputs.update({"mlp.gate_proj": x_mlp, "mlp.down_proj": hidden})
    searches = [
        (
            layer.input_layernorm,
            [attn.q_proj, attn.k_proj, attn.v_proj],
            "self_attn.q_proj",
            stages.attention_output,
        ),
        (
            layer.post_attention_layernorm,
            [mlp.gate_proj, mlp.up_proj],
            "mlp.gate_proj",
            stages.mlp_output,
        ),
        (mlp.up_proj, [mlp.down_proj], "mlp.down_proj", mlp.down_proj),
    ]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        searches.insert(1, (attn.v_proj, [attn.o_proj], "self_attn.o_proj", attn.o_proj))
    found = [
        (prev, linears, name, search_scale(inputs[name], linears, block, group_size, num_search))
        for prev, linears, name, block in searches
    ]
    for prev, linears, name, scales in found:
        fold_scale(prev, linears, scales)
        inputs[name] = inputs[name] / scales
    inputs["self_attn.v_proj"] = inputs["self_attn.k_proj"] = inputs["self_attn.q_proj"]
    inputs["mlp.up_proj"] = inputs["mlp.gate_proj"]
    results = {}
    for name, x in inputs.items():
        linear = layer.get_submodule(name)
        if name not in NOT_CLIPPED:
            linear.weight.data = clip_weight(linear.weight.data, x, group_size)
        results[name] = quantize_rtn(linear.weight.data, 4, group_size, sym=False, style="awq")
    return out, results


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ's 4-bit asymmetric round trip of ``weight [N, K]``."""
    n, k = weight.shape
    flat = weight.reshape(-1, k if group_size == -1 else group_size)  # [N * groups, G]
    scale, zero = group_params(flat, 4, sym=False, style="awq")
    codes = quantize_values(flat, scale, zero, 4)
    return ((codes - zero[:, None]) * scale[:, None]).reshape(n, k)


def search_scale(
    x: torch.Tensor,
    linears: list[nn.Linear],
    block: Callable[[torch.Tensor], torch.Tensor],
    group_size: int,
    num_search: int,
) -> torch.Tensor:
    """The per-input-channel scale ``[K]`` whose alpha minimizes ``block``'s output error."""
    x_search = x[:num_search]
    return best_scale(mean_abs(x), linears, lambda: chunked(block, x_search), group_size)


def mean_abs(x: torch.Tensor) -> torch.Tensor:
    """``mean|x|`` per input channel ``[K]`` of ``x [..., K]``."""
    return x.abs().reshape(-1, x.shape[-1]).mean(0)


def best_scale(
    x_mean: torch.Tensor,
    linears: list[nn.Module],
    run: Callable[[], torch.Tensor],
    group_size: int,
) -> torch.Tensor:
    """The scale ``[K]`` from ``x_mean`` whose alpha gives ``run()`` (a block's output on the
    search samples, computed from the linears' current weights) the least error when
    ``linears`` (``nn.Linear`` or Conv1D) hold ``Q(W * s) / s``; their weights are restored."""
    reference = run()
    stored = [linear.weight.data for linear in linears]
    originals = [linear_weight(linear) for linear in linears]  # [N, K] each
    best_error, best = float("inf"), torch.ones_like(x_mean)
    try:
        for i in range(NUM_ALPHAS + 1):
            scales = x_mean.pow(i / NUM_ALPHAS).clamp(min=1e-4)
            scales = scales / (scales.max() * scales.min()).sqrt()  # [K]
            for linear, weight in zip(linears, originals):
                set_weight(linear, fake_quantize(weight * scales, group_size) / scales)
            error = float((run() - reference).pow(2).mean())
            if error < best_error:
                best_error, best = error, scales
    finally:
        for linear, weight in zip(linears, stored):
            linear.weight.data = weight
    return best


def set_weight(linear: nn.Module, weight: torch.Tensor) -> None:
    """Store ``weight [N, K]`` in an ``nn.Linear`` (as is) or a Conv1D (as ``[K, N]``)."""
    linear.weight.data = weight.T.contiguous() if is_conv1d(linear) else weight


def fold_scale(
    prev: nn.Module, linears: list[nn.Module], scales: torch.Tensor, norm_offset: float = 0.0
) -> None:
    """``W <- W * s`` for ``linears``; the output of ``prev`` divided by ``s``, so the float
    model computes the same: a linear's last ``K`` output rows and bias (``v_proj``, or the
    up half of a fused gate/up), or a norm's weight and bias. A norm computing
    ``x_hat * (norm_offset + w)`` (Gemma: 1 + w) gets ``w' = (offset + w) / s - offset``."""
    with torch.no_grad():
        if isinstance(prev, nn.Linear) or is_conv1d(prev):
            linear_weight(prev)[-scales.numel() :] /= scales[:, None]
            if prev.bias is not None:
                prev.bias[-scales.numel() :] /= scales
        else:
            if norm_offset:
                prev.weight.copy_((prev.weight + norm_offset) / scales - norm_offset)
            else:
                prev.weight /= scales
            if getattr(prev, "bias", None) is not None:
                prev.bias /= scales
        for linear in linears:
            linear_weight(linear).mul_(scales[None, :])


def clip_weight(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight [N, K]`` clamped per row and group to the range with the least output error
    on ``CLIP_TOKENS`` evenly spaced tokens of ``x [..., K]``."""
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    tokens = x.reshape(-1, k)
    tokens = tokens[:: max(1, tokens.shape[0] // CLIP_TOKENS)][:CLIP_TOKENS]
    xg = tokens.reshape(-1, k // g, g).transpose(0, 1)  # [groups, tokens, G]
    wg = weight.reshape(n, k // g, g).permute(1, 2, 0)  # [groups, G, N]
    reference = xg @ wg  # [groups, tokens, N]
    max_abs = wg.abs().amax(dim=1, keepdim=True)  # [groups, 1, N]
    best_max, best_error = max_abs.clone(), torch.full_like(max_abs, float("inf"))
    for i in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
        limit = max_abs * (1 - i / CLIP_GRID)
        clipped = torch.maximum(torch.minimum(wg, limit), -limit)
        error = (xg @ _fake_quantize_columns(clipped) - reference).pow(2).mean(1, keepdim=True)
        better = error < best_error
        best_error, best_max = (
            torch.where(better, error, best_error),
            torch.where(better, limit, best_max),
        )
    limit = best_max.permute(2, 0, 1).reshape(n, k // g, 1)  # [N, groups, 1]
    clamped = torch.maximum(torch.minimum(weight.reshape(n, k // g, g), limit), -limit)
    return clamped.reshape(n, k)


def _fake_quantize_columns(wg: torch.Tensor) -> torch.Tensor:
    """AWQ's round trip of ``[groups, G, N]``, one (scale, zero) per group and column."""
    groups, g, n = wg.shape
    flat = wg.permute(0, 2, 1).reshape(groups * n, g)  # [groups * N, G]
    scale, zero = group_params(flat, 4, sym=False, style="awq")
    q = torch.clamp(torch.round(flat / scale[:, None]) + zero[:, None], 0, 15)
    return ((q - zero[:, None]) * scale[:, None]).reshape(groups, n, g).permute(0, 2, 1)

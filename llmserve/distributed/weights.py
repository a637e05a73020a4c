"""Cutting weights to one tensor-parallel rank's share, float or quantized, as they stream.

Two places, one rule (``plan.py`` says which heads, MLP columns and vocabulary rows a rank has):

    shard_weights   the Llama family (models/llama.py): checkpoint tensors by their Hugging Face
                    names, before the model sees them (q/k/v_proj, o_proj, gate/up/down_proj)
    cut_for_rank    the models/decoder.py families: each tensor in our names (``qkv_proj#q``,
                    a whole fused ``qkv_proj``, ``gate_up_proj#up``, ``w13#E:gate``, ...), after
                    the family's own layout change (per-head qkv, Conv1D), so one rule serves
                    GPT-2, Falcon, BLOOM, Phi-3, Gemma, the mixtures of experts, ...

    column-parallel (rows cut)    q / k / v rows of the rank's heads, gate / up / up_proj rows and
                                  biases of its MLP columns (each expert's, for a MoE)
    row-parallel (columns cut)    o_proj and down_proj (each expert's w2) input columns; their
                                  bias is added on rank 0 only (zeros elsewhere), since the
                                  outputs are summed over ranks
    vocabulary                    embedding and LM head rows (and LM head bias), padded
    anything else                 whole on every rank (norms, routers, positions, ...)

Quantized weights (GGUF blocks, GPTQ/AWQ layers) are cut the same way: rows as they are, columns
on group and 32-column block boundaries (``QuantizedWeight.select_cols``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from llmserve.distributed.plan import RankShard
from llmserve.quantization.layout import QuantizedWeight, concat_rows

Weight = torch.Tensor | QuantizedWeight


def shard_weights(
    weights: Iterator[tuple[str, Weight]], shard: RankShard
) -> Iterator[tuple[str, Weight]]:
    """The Llama family: slice each full checkpoint tensor (Hugging Face names) to ``shard`` as
    it streams by; the full tensor is dropped before the next one is read."""
    q, kv, mlp = _slices(shard)
    for name, tensor in weights:
        is_bias = name.endswith(".bias")
        if ".q_proj." in name:
            tensor = _rows(tensor, q)
        elif ".k_proj." in name or ".v_proj." in name:
            tensor = _rows(tensor, kv)
        elif ".o_proj." in name:
            tensor = _row_parallel_bias(tensor, shard) if is_bias else _cols(tensor, q, name)
        elif ".gate_proj." in name or ".up_proj." in name:
            tensor = _rows(tensor, mlp)
        elif ".down_proj." in name:
            tensor = _row_parallel_bias(tensor, shard) if is_bias else _cols(tensor, mlp, name)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensor = _vocab_rows(tensor, shard)
        yield name, tensor.contiguous() if isinstance(tensor, torch.Tensor) else tensor


def cut_for_rank(name: str, part: str, tensor: Weight, shard: RankShard) -> Weight:
    """A decoder.py family's tensor for our parameter ``name`` (``part`` as in its ``#part``:
    "", q, k, v, gate, up, "E" or "E:gate" / "E:up" for expert E), cut to ``shard``."""
    q, kv, mlp = _slices(shard)
    d = shard.head_dim
    is_bias = name.endswith(".bias")
    module = name.rpartition(".")[0]  # layers.3.self_attn.qkv_proj
    if module.endswith(".qkv_proj"):
        if part == "q":
            return _rows(tensor, q)
        if part in ("k", "v"):
            return _rows(tensor, kv)
        q_rows, kv_rows = shard.num_heads * d, shard.num_kv_heads * d  # whole [q; k; v]
        return _cat_rows(
            [
                _rows(tensor, q),
                _rows(tensor, _shift(kv, q_rows)),
                _rows(tensor, _shift(kv, q_rows + kv_rows)),
            ]
        )
    if module.endswith(".o_proj"):
        return _row_parallel_bias(tensor, shard) if is_bias else _cols(tensor, q, name)
    if module.endswith(".up_proj"):  # an MLP without a gate (GPT-2, BLOOM, ...)
        return _rows(tensor, mlp)
    if module.endswith(".gate_up_proj"):
        if part in ("gate", "up"):
            return _rows(tensor, mlp)
        half = tensor.shape[0] // 2  # whole [gate; up] (Phi-3)
        return _cat_rows([_rows(tensor, mlp), _rows(tensor, _shift(mlp, half))])
    if module.endswith(".down_proj"):
        return _row_parallel_bias(tensor, shard) if is_bias else _cols(tensor, mlp, name)
    experts = slice(*(shard.expert_intermediate or shard.intermediate))
    if name.endswith(".mlp.w13"):  # expert E's gate or up rows
        return _rows(tensor, experts)
    if name.endswith(".mlp.w2"):  # expert E's down projection
        return _cols(tensor, experts, name)
    if name in ("embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
        return _vocab_rows(tensor, shard)
    return tensor


def _slices(shard: RankShard) -> tuple[slice, slice, slice]:
    """The rank's rows of q, of k (or v), and its MLP columns."""
    d = shard.head_dim
    q = slice(shard.q_heads[0] * d, shard.q_heads[1] * d)
    kv = slice(shard.kv_heads[0] * d, shard.kv_heads[1] * d)
    return q, kv, slice(*shard.intermediate)


def _shift(s: slice, offset: int) -> slice:
    return slice(s.start + offset, s.stop + offset)


def _rows(tensor: Weight, rows: slice) -> Weight:
    if isinstance(tensor, QuantizedWeight):
        return tensor.select_rows(torch.arange(rows.start, rows.stop))
    return tensor[rows]


def _cat_rows(parts: list[Weight]) -> Weight:
    if isinstance(parts[0], QuantizedWeight):
        return concat_rows(parts)
    return torch.cat(parts)


def _cols(tensor: Weight, cols: slice, name: str) -> Weight:
    if not isinstance(tensor, QuantizedWeight):
        return tensor[:, cols]
    try:
        return tensor.select_cols(cols.start, cols.stop)
    except ValueError as e:
        raise ValueError(
            f"{name}: this rank's input columns {cols.start}..{cols.stop} cannot be cut from "
            f"the quantized weight ({e}); run this checkpoint with --tensor-parallel-size 1 "
            "(or quantize it with a group size that divides each rank's share)"
        ) from None


def _row_parallel_bias(bias: torch.Tensor, shard: RankShard) -> torch.Tensor:
    return bias if shard.rank == 0 else torch.zeros_like(bias)


def _vocab_rows(table: Weight, shard: RankShard) -> Weight:
    start, end = shard.vocab
    rows = _rows(table, slice(start, end))  # [<= vocab_per_rank, ...]
    pad = shard.vocab_per_rank - rows.shape[0]
    if not pad:
        return rows
    if isinstance(rows, QuantizedWeight):
        return rows.pad_rows(pad)
    return torch.nn.functional.pad(rows, (0, 0) * (rows.dim() - 1) + (0, pad))

"""``LoRALinear``: a linear layer plus the low-rank term of each adapter in the step.

One step's rows belong to requests of different adapters (or none):

    rows:       d0  d1  d2  p0 p0 p0  p1 p1
    adapter:    1   0   1   2  2  2   0  0          (0: the base model)
    groups:     adapter 1 -> rows [0, 2]; adapter 2 -> rows [3, 4, 5]

``y = base(x)``, then for each group ``y[rows] += (x[rows] @ A^T) @ (s B^T)``: two small
matmuls per adapter and layer (r is 8-64 against hundreds or thousands of features), through
llmserve's packed GEMMs where the CPU packs the dtype (``LowRank``). A step whose rows all run
one adapter skips the gather and scatter. The model's last layer finishes
only the rows that sample (``AttentionMetadata.output_rows``); its layers see those rows, and
the groups of the output rows serve them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.layers.cpu_linear import PackedLinear, can_pack
from llmserve.layers.module import Module

Group = tuple[int, torch.Tensor | None]  # adapter id, its rows (None: every row)


@dataclass
class LoRABatch:
    """The rows of each adapter in the step; shared by every ``LoRALinear`` of the model."""

    device: torch.device = torch.device("cpu")
    num_rows: int = 0
    groups: list[Group] = field(default_factory=list)
    num_output_rows: int = 0
    output_groups: list[Group] = field(default_factory=list)

    def set(self, row_adapters: list[int], output_rows: torch.Tensor | None) -> None:
        """``row_adapters``: each row's adapter id (0: none); ``output_rows``: the rows the
        last layer finishes, or None for all."""
        self.num_rows = len(row_adapters)
        self.groups = _groups(row_adapters, self.device)
        if output_rows is None or not self.groups:
            self.num_output_rows, self.output_groups = self.num_rows, self.groups
            return
        kept = [row_adapters[i] for i in output_rows.tolist()]
        self.num_output_rows, self.output_groups = len(kept), _groups(kept, self.device)

    def groups_for(self, num_rows: int) -> list[Group]:
        if not self.groups:
            return self.groups
        if num_rows == self.num_rows:
            return self.groups
        if num_rows == self.num_output_rows:
            return self.output_groups
        raise RuntimeError(
            f"a LoRA layer got {num_rows} rows; the step has {self.num_rows} "
            f"({self.num_output_rows} output rows)"
        )


def _groups(row_adapters: list[int], device: torch.device) -> list[Group]:
    ids = sorted(set(row_adapters) - {0})
    if len(ids) == 1 and all(a == ids[0] for a in row_adapters):
        return [(ids[0], None)]
    groups = []
    for adapter in ids:
        rows = [i for i, a in enumerate(row_adapters) if a == adapter]
        groups.append((adapter, torch.tensor(rows, dtype=torch.int64).to(device)))
    return groups


class LowRank:
    """``x -> (x A^T)(s B^T)``. On CPUs that pack the dtype, both matmuls go through
    ``PackedLinear`` (llmserve's GEMMs), since torch's run such thin matmuls far below their
    rate: on AMD Zen 5, a bf16 q/k/v layer ([576 -> 960], rank 16 x 3) with its adapter took
    45 us a row of decode by torch against 15 us packed (8 us without the adapter), 144
    against 123 us at 64 rows; elsewhere two matmuls."""

    def __init__(self, a_t: torch.Tensor, b_t: torch.Tensor):
        self.a_t, self.b_t = a_t, b_t  # [in, r], [r, out]
        self.shrink = self.expand = None
        if can_pack(a_t.device, a_t.dtype):
            self.shrink = PackedLinear(_linear(a_t.T), batch_size_hint=64)
            self.expand = PackedLinear(_linear(b_t.T), batch_size_hint=64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.shrink is None:
            return (x @ self.a_t) @ self.b_t
        return self.expand(self.shrink(x))


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight.contiguous()
    return linear


class LoRALinear(Module):
    """``base(x)`` plus each adapter's ``(x A^T)(s B^T)`` on that adapter's rows."""

    def __init__(self, base: torch.nn.Module, batch: LoRABatch):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.batch = batch
        self.adapters: dict[int, LowRank] = {}  # adapter id -> its (x A^T)(s B^T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for adapter, rows in self.batch.groups_for(x.shape[0]):
            low_rank = self.adapters.get(adapter)
            if low_rank is None:  # this adapter leaves this layer as it is
                continue
            if rows is None:
                y.add_(low_rank(x))
            else:
                y.index_add_(0, rows, low_rank(x.index_select(0, rows)))
        return y

    def extra_repr(self) -> str:
        return f"adapters={sorted(self.adapters)}"

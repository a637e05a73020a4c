"""The loaded adapters and the model's layers they wrap (the model runner owns one).

An adapter is loaded when the engine first sees a request for it (so a bad adapter is that
request's error, not a failed step) and stays loaded, least recently used first out, while
more than ``--max-cpu-loras`` are: an adapter a queued or running request names is never
dropped. Layers become ``LoRALinear`` the first time an adapter adapts them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import torch

from llmserve.lora.layers import LoRABatch, LoRALinear, LowRank
from llmserve.lora.request import LoRARequest
from llmserve.lora.weights import load_adapter

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        model: torch.nn.Module,
        max_rank: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.model = model
        self.max_rank = max_rank
        self.capacity = capacity
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch(device)
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()  # least recently used first
        self.layers: dict[str, LoRALinear] = {}

    def add(self, request: LoRARequest, in_use: Iterable[int] = ()) -> bool:
        """Load ``request``'s adapter unless loaded; True if it was loaded now. ``in_use``:
        adapter ids that requests still name (kept even beyond the capacity)."""
        known = self.loaded.get(request.lora_int_id)
        if known is None:
            weights = load_adapter(self.model, request, self.max_rank, self.dtype, self.device)
            for name, (a_t, b_t) in weights.items():
                self._layer(name).adapters[request.lora_int_id] = LowRank(a_t, b_t)
            self.loaded[request.lora_int_id] = request
            logger.info(
                "LoRA adapter %s (id %d) loaded from %s: %d layers",
                request.lora_name,
                request.lora_int_id,
                request.lora_path,
                len(weights),
            )
        elif known.lora_path != request.lora_path:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is loaded from {known.lora_path!r}; "
                f"{request.lora_path!r} needs an id of its own"
            )
        self.loaded.move_to_end(request.lora_int_id)
        self._evict({request.lora_int_id, *in_use})
        return known is None

    def remove(self, lora_int_id: int) -> bool:
        if self.loaded.pop(lora_int_id, None) is None:
            return False
        for layer in self.layers.values():
            layer.adapters.pop(lora_int_id, None)
        return True

    def prepare(self, row_adapters: list[int], output_rows: torch.Tensor | None) -> None:
        """The step's rows per adapter (``row_adapters``: each row's adapter id, 0 for none)."""
        self.batch.set(row_adapters, output_rows)
        missing = [adapter for adapter, _ in self.batch.groups if adapter not in self.loaded]
        if missing:  # a layer would run it as the base model, silently
            raise RuntimeError(f"LoRA adapters {missing} are scheduled but not loaded")

    def _evict(self, keep: set[int]) -> None:
        while len(self.loaded) > self.capacity:
            victim = next((i for i in self.loaded if i not in keep), None)
            if victim is None:
                return
            logger.info("LoRA adapter id %d unloaded (--max-cpu-loras %d)", victim, self.capacity)
            self.remove(victim)

    def _layer(self, name: str) -> LoRALinear:
        layer = self.layers.get(name)
        if layer is None:
            layer = LoRALinear(self.model.get_submodule(name), self.batch)
            self.model.set_submodule(name, layer)
            self.layers[name] = layer
        return layer

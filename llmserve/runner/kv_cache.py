"""Sizing and allocating the paged KV cache, and the arithmetic the engine prints.

Memory per token = 2 (K and V) x bytes per value x layers x kv_heads x head_dim.

``--kv-cache-dtype`` picks the bytes per value: the model's dtype (auto), bfloat16, or one byte
of fp8 (e4m3: 3 mantissa bits, up to 448; e5m2: 2 bits, up to 57344). A quantized pool holds
K / k_scale and V / v_scale (each attention layer's ``k_scale`` / ``v_scale``, 1.0 unless
set), rounded to nearest even and saturated at the format's largest value; the attention
kernels widen it back to fp32 as they read (kernels/cpu/fp8.h; layers/kv_quant.py on the
torch paths). Every read sees the rounded values, a prompt's own rows included (its first
chunk too, as vLLM's kernels read the pool they just wrote): decode and prefill attend over
the same numbers, whichever backend and path runs them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from llmserve.config import CacheConfig
from llmserve.memory import HUGE_PAGE, huge_page_bytes

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
GIB = float(1 << 30)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one layer's pool and what one token costs across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * elem * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


_KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, backend: str) -> torch.dtype:
    """``--kv-cache-dtype`` as a torch dtype for a model computing in ``model_dtype``."""
    if name == "auto":
        return model_dtype
    if name not in _KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not one of auto, {', '.join(_KV_DTYPES)}")
    dtype = _KV_DTYPES[name]
    if dtype == model_dtype:
        return dtype
    if backend == "triton":
        raise ValueError(
            f"--kv-cache-dtype {name} runs on the cpp and torch attention backends; the Triton "
            "kernels read the model's dtype only: use --attention-backend torch"
        )
    if dtype == torch.bfloat16 and model_dtype != torch.float32:
        raise ValueError(
            f"--kv-cache-dtype bfloat16 narrows an fp32 model's cache; this model runs in "
            f"{model_dtype} (use auto, fp8 or fp8_e5m2)"
        )
    return dtype


def kv_cache_budget(cache: CacheConfig, device: torch.device) -> int:
    """Bytes the KV cache may take on ``device`` (weights already loaded)."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    activation_reserve = 1 << 30
    return max(0, int(total * cache.gpu_memory_utilization) - used - activation_reserve)


def describe(spec: KVCacheSpec, num_blocks: int, max_model_len: int) -> str:
    """The KV arithmetic, for the start-up log."""
    tokens = num_blocks * spec.block_size
    per_token = spec.bytes_per_token
    per_seq = per_token * max_model_len
    return (
        f"KV cache: {per_token} B/token in {str(spec.dtype).removeprefix('torch.')} "
        f"(2 x {torch.empty((), dtype=spec.dtype).element_size()} B x "
        f"{spec.num_layers} layers x {spec.num_kv_heads} kv heads x {spec.head_dim} head_dim); "
        f"{num_blocks} blocks x {spec.block_size} tokens = {tokens} tokens "
        f"({num_blocks * spec.bytes_per_block / GIB:.2f} GiB); one {max_model_len}-token sequence needs "
        f"{per_seq / GIB:.3f} GiB, so {tokens / max_model_len:.2f} full-length sequences fit"
    )


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool, its memory faulted in now. On a Linux CPU, in transparent huge pages
    (``memory.huge_page_bytes``): a decode step reads blocks scattered over the pool, and with
    4 KiB pages a 12 KiB block spans 3-4 pages, each a TLB miss. The gain measured so far is
    small (``python -m llmserve.benchmarks.decode_attention``, which times both: 0-3% on the
    AVX2 Zen 3 host)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = None
    if device.type == "cpu" and nbytes >= HUGE_PAGE:
        raw = huge_page_bytes(nbytes, populate=True)
    if raw is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return raw.view(dtype).view(shape)


def allocate(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, backend: str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pool pair per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    With the ``cpp`` attention backend each K block is stored as ``[num_kv_heads, head_dim,
    block_size]`` and returned as a view with the usual shape, so every reader that indexes it
    still works, while the C++ kernels read a row of block_size tokens per head dimension as
    one vector (scores without sums across lanes; dots_t in attention_scores_impl.h)."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def keys() -> torch.Tensor:
        if backend != "cpp":
            return zeros(shape, spec.dtype, device)
        stored = (num_blocks, spec.num_kv_heads, spec.head_dim, spec.block_size)
        return zeros(stored, spec.dtype, device).permute(0, 3, 1, 2)

    return [(keys(), zeros(shape, spec.dtype, device)) for _ in range(spec.num_layers)]


def transposed_keys(k_cache: torch.Tensor) -> torch.Tensor:
    """The same K values in the ``cpp`` backend's layout (see ``allocate``): a copy stored
    ``[num_blocks, num_kv_heads, head_dim, block_size]``, seen with ``k_cache``'s shape."""
    return k_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]
) -> None:
    """Apply copy-on-write: block ``dst`` becomes a copy of block ``src`` in every layer."""
    if not copies:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in copies], device=device)
    dst = torch.tensor([d for _, d in copies], device=device)
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


class SwapSpace:
    """CPU memory for the KV blocks of swapped-out sequences: ``num_blocks`` slots per layer,
    allocated on the first swap-out (untouched pages cost nothing until then)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, pin_memory: bool = False):
        self.spec, self.num_blocks, self.pin_memory = spec, num_blocks, pin_memory
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _allocate(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.caches is None:
            spec = self.spec
            shape = (self.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
            self.caches = [
                tuple(
                    torch.empty(shape, dtype=spec.dtype, pin_memory=self.pin_memory)
                    for _ in range(2)
                )
                for _ in range(spec.num_layers)
            ]
        return self.caches

    def swap_out(self, kv_caches, pairs: list[tuple[int, int]]) -> None:
        """Slot ``slot`` of every layer gets a copy of pool block ``block`` ((block, slot))."""
        if pairs:
            blocks = torch.tensor([b for b, _ in pairs], device=kv_caches[0][0].device)
            slots = torch.tensor([s for _, s in pairs])
            for pool, swap in zip(kv_caches, self._allocate()):
                for cache, store in zip(pool, swap):
                    store[slots] = cache[blocks].to("cpu")

    def swap_in(self, kv_caches, pairs: list[tuple[int, int]]) -> None:
        """Pool block ``block`` of every layer gets the swapped copy in ``slot`` ((slot, block))."""
        if pairs:
            device = kv_caches[0][0].device
            slots = torch.tensor([s for s, _ in pairs])
            blocks = torch.tensor([b for _, b in pairs], device=device)
            for pool, swap in zip(kv_caches, self._allocate()):
                for cache, store in zip(pool, swap):
                    cache[blocks] = store[slots].to(device, non_blocking=self.pin_memory)

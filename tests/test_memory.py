"""llmserve.memory: glibc's heap keeps the freed blocks of a step for the next one
(``keep_freed_memory``), instead of mapping large blocks afresh, page faults and all."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from llmserve.memory import _glibc

# In a fresh interpreter: the bytes glibc holds in mmapped blocks (mallinfo2's hblkhd) while a
# 40 MiB tensor lives, with the defaults or after keep_freed_memory.
PROBE = """
import ctypes, sys, torch
from llmserve.memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
block = torch.ones(10 << 20)  # 40 MiB, above glibc's 32 MiB mmap ceiling
print(libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.skipif(
    _glibc() is None or not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33+ only"
)
def test_large_blocks_come_from_the_heap_once_kept():
    def mapped(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
        )
        return int(out.stdout.split()[-1])

    assert mapped("default") >= 40 << 20  # a mapping of its own
    assert mapped("keep") < 1 << 20  # from the heap, where a freed one stays for the next

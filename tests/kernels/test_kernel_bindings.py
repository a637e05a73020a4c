"""The direct bindings of the C++ kernels let go of the GIL while a kernel runs
(kernels/cpu/bindings.h), as torch's own ops do: another Python thread, such as the server's
event loop beside the engine thread, keeps running during a step's kernels.

The probe: one thread calls the kernel a few times and notes when each call began and ended;
the main thread wakes every half millisecond and notes the time. Wake-ups that fall inside a
call happened while the kernel ran. A call that holds the GIL lets at most one in at each edge
(a forced switch between noting the time and entering the call); the control test shows the
probe telling the two apart on a C call that keeps the GIL (``list.sort``).
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Callable

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.kernels.cpu import quant
from llmserve.quantization.layout import QuantizedWeight, pack_int4

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

CALLS = 3


def wakeups_inside(call: Callable[[], object]) -> int:
    """How many of the main thread's wake-ups fell inside one of CALLS calls of ``call``."""
    calls: list[tuple[float, float]] = []
    done = threading.Event()

    def caller() -> None:
        for _ in range(CALLS):
            start = time.perf_counter()
            call()
            calls.append((start, time.perf_counter()))
        done.set()

    wakeups = []
    thread = threading.Thread(target=caller)
    thread.start()
    while not done.is_set():
        time.sleep(0.0005)
        wakeups.append(time.perf_counter())
    thread.join()
    return sum(any(start < t < end for start, end in calls) for t in wakeups)


def test_probe_sees_a_call_that_holds_the_gil():
    values = [random.random() for _ in range(1_000_000)]
    assert wakeups_inside(lambda: sorted(values)) <= 2 * CALLS


def test_fp32_linear_lets_go_of_the_gil():
    assert cpu_kernels.available()
    x, w = torch.randn(512, 4096), torch.randn(4096, 4096)
    packed = cpu_kernels.linear_f32_pack(w)
    assert wakeups_inside(lambda: cpu_kernels.linear_f32(x, packed, 4096, None)) > 4 * CALLS


@pytest.mark.parametrize("kernel", ["quant_linear", "quant_linear_f32"])
def test_quantized_linears_let_go_of_the_gil(kernel):
    assert quant.available()
    n = k = 4096
    weight = QuantizedWeight(
        4, pack_int4(torch.randint(0, 16, (n, k))), torch.rand(n, k // 32) * 0.02, None, 32
    )
    x = torch.randn(256, k)
    run = getattr(quant, kernel)
    assert wakeups_inside(lambda: run(x, weight, None)) > 4 * CALLS

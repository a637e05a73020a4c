"""The CPU engine's compute threads pinned one per core while it steps.

torch runs a CPU step on the thread that calls it plus its OpenMP workers, one per core. Left
to the OS, those threads move between cores whenever something else wakes up on the machine:
the server's event loop, a benchmark client on the same host, the OS. A step's parallel
regions then wait at their barriers for a thread that was moved or is sharing a core with its
sibling. vLLM's CPU worker pins its OpenMP threads for that reason (VLLM_CPU_OMP_THREADS_BIND);
llmserve does the same. Measured on a 2-core Zen 4 VM, alternated runs with and without: 1-3%
more output tok/s in the means of the server at once and the offline batches (bf16 text2sql
7.5%), and a narrower spread between runs (docs/bench/journal.md, "compute threads pinned").
On a 2-core Intel Sapphire Rapids class VM the bf16 server read the other way: unpinned ahead
in six of seven alternated rounds, by 4.6-6% in the means (offline alike; docs/bench/journal.md,
"An Intel Sapphire Rapids class host again"), so auto pins nothing on Intel CPUs.

``LLMSERVE_CPU_OMP_THREADS_BIND`` (vLLM's variable under llmserve's prefix):

    auto (default)  one CPU per physical core of this process's affinity mask, in order, when
                    torch's thread count equals that number of cores: the engine owns the
                    cores it may run on. Otherwise (tensor-parallel ranks or data-parallel
                    replicas that split the cores, a smaller ``torch.set_num_threads``) no
                    thread is pinned: which cores are free is not this process's to know.
                    Nothing is pinned on Intel CPUs either (measured slower there, above).
    nobind          no thread is pinned
    0-1,4           these CPUs, one torch thread each (torch's thread count becomes their
                    number, as vLLM does)

The server's engine thread is pinned for its life; ``LLM.generate`` pins the calling thread
while it steps and gives it its own CPUs back after, so threads the caller starts later are
not confined to one core (the OpenMP workers stay pinned: only the caller's torch ops use
them). GPU engines and engines without the C++ kernels (which do the pinning) pin nothing.
Under tensor parallelism only rank 0's process (the one that steps) reads the setting; the
other ranks never pin. A list there pins rank 0's threads to those CPUs and sets its thread
count, so it should name CPUs the other ranks do not use; auto pins nothing there.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from llmserve import cpuinfo

logger = logging.getLogger(__name__)

ENV = "LLMSERVE_CPU_OMP_THREADS_BIND"
_SYS_CPU = Path("/sys/devices/system/cpu")
_logged: set[tuple[int, ...]] = set()


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``; raises ValueError saying what is allowed."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or int(last or first) < int(first):
            cpus = []
            break
        cpus.extend(range(int(first), int(last or first) + 1))
    if not cpus or len(set(cpus)) != len(cpus):
        raise ValueError(
            f"{ENV}={text!r}: expected auto, nobind or a list of distinct CPUs such as 0-3,8"
        )
    return cpus


def physical_cores(allowed: set[int]) -> dict[tuple[int, int], list[int]]:
    """The allowed CPUs grouped by (package, core): SMT siblings share a key. Where the
    topology is not readable every CPU counts as its own core."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(allowed):
        topology = _SYS_CPU / f"cpu{cpu}" / "topology"
        try:
            package = int((topology / "physical_package_id").read_text())
            core = int((topology / "core_id").read_text())
        except (OSError, ValueError):
            package, core = -1, cpu
        cores.setdefault((package, core), []).append(cpu)
    return cores


def plan_cpus(
    spec: str,
    num_threads: int,
    allowed: set[int],
    cores: dict[tuple[int, int], list[int]],
    auto_pins: bool = True,
) -> list[int] | None:
    """The CPU for each compute thread (slot 0: the stepping thread), or None to pin none.
    ``cores``: ``physical_cores(allowed)``; ``auto_pins``: whether auto pins on this CPU
    (``auto_pins_here``)."""
    spec = spec.strip().lower() or "auto"
    if spec == "nobind":
        return None
    if spec == "auto":
        if not auto_pins or num_threads < 2 or num_threads != len(cores):
            return None
        return [siblings[0] for siblings in cores.values()]
    cpus = parse_cpu_list(spec)
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ValueError(
            f"{ENV}={spec!r}: CPUs {outside} are not in this process's affinity mask "
            f"{sorted(allowed)}"
        )
    return cpus


@contextlib.contextmanager
def compute_threads_bound(device: torch.device | str | None) -> Iterator[list[int] | None]:
    """Pin the calling thread and torch's OpenMP workers as ``LLMSERVE_CPU_OMP_THREADS_BIND``
    says for the block; the calling thread gets its own CPUs back after. Yields the CPUs, or
    None where nothing was pinned (a GPU or unknown device, nobind, no kernels)."""
    cpus = _planned_cpus(device)
    if cpus is None:
        yield None
        return
    previous = os.sched_getaffinity(0)
    _bind(cpus)
    try:
        yield cpus
    finally:
        os.sched_setaffinity(0, previous)


def check_bind_setting() -> None:
    """Raise ValueError for a bad ``LLMSERVE_CPU_OMP_THREADS_BIND`` (the engine asks before it
    loads the model)."""
    _plan(num_threads=0)


def _planned_cpus(device: torch.device | str | None) -> list[int] | None:
    """What ``compute_threads_bound`` pins here, now."""
    if device is None or torch.device(device).type != "cpu":
        return None
    from llmserve.kernels import cpu as cpu_kernels

    cpus = _plan(torch.get_num_threads())
    return cpus if cpus is not None and cpu_kernels.available() else None


def _plan(num_threads: int) -> list[int] | None:
    """``plan_cpus`` for this process's setting and affinity mask (None where the OS has no
    affinity calls)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    spec = os.environ.get(ENV, "auto")
    return plan_cpus(spec, num_threads, allowed, physical_cores(allowed), auto_pins_here())


def auto_pins_here() -> bool:
    """Whether auto pins on this CPU: not on Intel (the module docstring), elsewhere yes."""
    return not cpuinfo.is_intel()


def _bind(cpus: list[int]) -> None:
    from llmserve.kernels import cpu as cpu_kernels

    if torch.get_num_threads() != len(cpus):
        torch.set_num_threads(len(cpus))
    pinned = cpu_kernels.bind_threads(cpus)
    if pinned != len(cpus):
        logger.warning("pinned %d of %d compute threads to CPUs %s", pinned, len(cpus), cpus)
    elif tuple(cpus) not in _logged:
        _logged.add(tuple(cpus))
        logger.info("compute threads pinned one per CPU: %s (%s)", cpus, ENV)

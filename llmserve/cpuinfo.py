"""What Linux's /proc/cpuinfo (and /sys's cache sizes) say about this CPU, read once
(torch-free).

Several choices depend on the host: which kernels AVX-512 or AVX512_BF16 unlocks, where
llmserve's own GEMMs beat oneDNN (AMD Zen 4 and Zen 5), whether ``auto`` pins the compute
threads (not on Intel), and the CPU's name in every benchmark report. They all read it here.
Off Linux the fields are empty, so each rule falls back to its portable default.
"""

from __future__ import annotations

import functools
from pathlib import Path

CPU0_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's fields (vendor_id, cpu family, model name, flags...; empty where
    there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return cpuinfo_fields(f.read())
    except OSError:
        return {}


def cpuinfo_fields(cpuinfo: str) -> dict[str, str]:
    """The fields of /proc/cpuinfo's text, its first processor's block."""
    first = cpuinfo.split("\n\n", 1)[0]
    return dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in first.splitlines())
    )


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    return frozenset(cpu_fields().get("flags", "").split())


def is_amd_zen4() -> bool:
    """Whether this CPU is an AMD Zen 4 (False off Linux)."""
    return fields_are_amd_zen4(cpu_fields())


def is_amd_zen5() -> bool:
    """Whether this CPU is an AMD Zen 5 (False off Linux)."""
    return _is_amd_avx512(cpu_fields(), family="26")


def fields_are_amd_zen4(fields: dict[str, str]) -> bool:
    """AMD family 19h with AVX-512: Zen 4 (Zen 3 is family 19h without it, Zen 5 is 1Ah)."""
    return _is_amd_avx512(fields, family="25")


def _is_amd_avx512(fields: dict[str, str], family: str) -> bool:
    """An AMD CPU of this family (decimal, as Linux lists it) with AVX-512."""
    return (
        fields.get("vendor_id") == "AuthenticAMD"
        and fields.get("cpu family") == family
        and "avx512f" in fields.get("flags", "").split()
    )


def is_intel() -> bool:
    """Whether this CPU's vendor is Intel (False off Linux)."""
    return cpu_fields().get("vendor_id") == "GenuineIntel"


@functools.cache
def last_level_cache_bytes(caches: Path = CPU0_CACHES) -> int:
    """The size of the first CPU's last-level cache (the highest ``index*/level`` under
    ``caches``), or 0 where Linux does not say."""
    best_level, size = 0, 0
    for index in sorted(caches.glob("index*")):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text()
        except (OSError, ValueError):
            continue
        if level > best_level:
            best_level, size = level, cache_size_bytes(text)
    return size


def cache_size_bytes(text: str) -> int:
    """Bytes of a /sys cache ``size`` file's text: ``32K``, ``266240K``, ``32M``, ``1024``."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale

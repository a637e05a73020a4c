"""llmserve.cpuinfo: the one reader of /proc/cpuinfo behind every host rule."""

import os
import platform

import pytest

from llmserve import cpuinfo
from llmserve.benchmarks.report import machine_info

TWO_CPUS = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: Some Xeon
flags\t\t: fpu avx2 avx512f amx_tile

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu
"""


def test_fields_come_from_the_first_processor_block():
    fields = cpuinfo.cpuinfo_fields(TWO_CPUS)
    assert fields["vendor_id"] == "GenuineIntel"
    assert fields["model name"] == "Some Xeon"
    assert fields["flags"].split() == ["fpu", "avx2", "avx512f", "amx_tile"]
    assert not cpuinfo.fields_are_amd_zen4(fields)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="Linux only")
def test_this_hosts_flags_vendor_and_name_are_what_linux_lists():
    with open("/proc/cpuinfo") as f:
        lines = f.read().split("\n\n", 1)[0].splitlines()
    line = {k.strip(): v.strip() for k, _, v in (s.partition(":") for s in lines)}
    assert cpuinfo.cpu_flags() == frozenset(line["flags"].split())
    if platform.machine() == "x86_64":
        assert "sse2" in cpuinfo.cpu_flags()  # every x86-64 CPU
    assert cpuinfo.is_intel() == (line["vendor_id"] == "GenuineIntel")
    assert machine_info()["cpu"] == line["model name"]

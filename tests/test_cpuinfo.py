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


def test_the_last_level_cache_is_the_highest_level_listed(tmp_path):
    caches = [(0, 1, "48K"), (1, 1, "32K"), (2, 2, "2048K"), (3, 3, "260M")]
    for name, listed in [("all", caches), ("no_level_3", caches[:3])]:
        for index, level, size in listed:
            (tmp_path / name / f"index{index}").mkdir(parents=True)
            (tmp_path / name / f"index{index}" / "level").write_text(f"{level}\n")
            (tmp_path / name / f"index{index}" / "size").write_text(f"{size}\n")
    (tmp_path / "no_level_3" / "index3").mkdir()  # listed, but no level to read
    assert cpuinfo.last_level_cache_bytes(tmp_path / "all") == 260 << 20
    assert cpuinfo.last_level_cache_bytes(tmp_path / "no_level_3") == 2048 << 10
    assert cpuinfo.last_level_cache_bytes(tmp_path / "missing") == 0
    assert cpuinfo.cache_size_bytes("1024\n") == 1024


def test_the_linear_benchmark_cycles_weights_past_the_last_level_cache():
    from llmserve.benchmarks import fp32_linear

    llc = cpuinfo.last_level_cache_bytes()
    for weight_bytes in (1 << 20, 7 << 20, 113 << 20):
        copies = fp32_linear.default_copies(weight_bytes)
        assert copies >= fp32_linear.MIN_COPIES
        assert copies * weight_bytes >= 2 * llc
        assert copies == fp32_linear.MIN_COPIES or (copies - 1) * weight_bytes < 2 * llc


def test_machine_info_names_the_cpu_settings_a_run_used(monkeypatch):
    """LLMSERVE_CPU_* variables change what a CPU run measures, so the results record them;
    no other variable is recorded (an API key among them)."""
    from llmserve.benchmarks.report import machine_text

    for name in [k for k in os.environ if k.startswith("LLMSERVE_")]:
        monkeypatch.delenv(name)
    assert "llmserve_cpu_env" not in machine_info()
    monkeypatch.setenv("LLMSERVE_CPU_AMX_GEMM", "1")
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "avx2")
    monkeypatch.setenv("LLMSERVE_API_KEY", "secret")
    machine = machine_info()
    assert machine["llmserve_cpu_env"] == {"LLMSERVE_CPU_AMX_GEMM": "1", "LLMSERVE_CPU_ISA": "avx2"}
    assert machine_text(machine).endswith("; LLMSERVE_CPU_AMX_GEMM=1 LLMSERVE_CPU_ISA=avx2")

"""The C++ libraries share the process's C++ runtime instead of carrying a copy of their own.

On the GPU machine's image (2026-11-29) the toolchain linked libstdc++'s static archive into the
kernels' module, and every error message that formats a number (``TORCH_CHECK(..., K, ...)``)
crashed the process in the copied iostreams instead of raising. ``build.process_cxx_runtime``
links the library against the libstdc++ the process loaded; these tests check the built
modules for it (``readelf``, ``nm`` from binutils, which the compiler needs anyway) and that such
messages arrive as Python errors.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.kernels.cpu import build, quant

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

LIBRARIES = {"kernels": cpu_kernels.LIBRARY, "quant": quant.LIBRARY}


def test_the_process_runtime_is_found():
    (path,) = build.process_cxx_runtime()  # torch is C++: its runtime is loaded here
    assert "libstdc++.so" in path


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_library_links_the_shared_cxx_runtime(name):
    library = LIBRARIES[name]
    if not library.available():
        pytest.skip("the library did not build here")
    path = library.direct().__file__
    if shutil.which("readelf") is None or shutil.which("nm") is None:
        pytest.skip("no binutils")
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    assert "Shared library: [libstdc++.so.6]" in dynamic.stdout  # the module's own NEEDED
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True
    ).stdout.split()
    # std::basic_ostream's and std::locale's members belong to libstdc++.so, never to the module
    copied = [s for s in symbols if s.startswith(("_ZNSo", "_ZNSt6locale"))]
    assert copied == []


def test_formatted_error_messages_raise():
    if not cpu_kernels.available():
        pytest.skip("the kernels did not build here")
    with pytest.raises(RuntimeError, match="48 != weight's 7"):
        cpu_kernels.rms_norm(torch.randn(2, 48), torch.randn(7), 1e-6)
    packed = cpu_kernels.linear_bf16_pack(torch.randn(10, 48).bfloat16())
    with pytest.raises(RuntimeError, match=r"multiple of 32 \(got 48\)"):
        cpu_kernels.linear_bf16_amx(torch.randn(2, 48).bfloat16(), packed, 10, None, True)


def test_a_first_build_is_told_apart_from_a_cached_one(tmp_path, monkeypatch):
    """The log line of a first start says the library is being built (about a minute)."""
    library = cpu_kernels.LIBRARY
    if not library.available():
        pytest.skip("the library did not build here")
    assert library._built_before()  # the build available() just made or found
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache
    assert not library._built_before()

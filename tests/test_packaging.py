"""The built wheel carries what an installed llmserve needs at run time: the C++ CPU kernels
are compiled on the user's machine from their sources (llmserve/kernels/cpu), so a wheel
without the .cpp and .h files would leave every CPU host on the slow torch paths. Built
offline from a copy of the package with the test extra's setuptools (pyproject.toml)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_wheel_carries_every_kernel_source(tmp_path):
    # built from a copy, so that setuptools' build/ and egg-info stay out of the checkout
    source = tmp_path / "src"
    shutil.copytree(ROOT / "llmserve", source / "llmserve",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("llmserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = ROOT / "llmserve" / "kernels" / "cpu"
    sources = sorted(p.name for p in kernels.iterdir() if p.suffix in (".cpp", ".h"))
    assert sources, "no kernel sources found beside the test"
    missing = [s for s in sources if f"llmserve/kernels/cpu/{s}" not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert "llmserve/kernels/cpu/build.py" in names

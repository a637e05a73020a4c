"""Build-on-first-use for the C++ CPU libraries (torch's extension builder, cached by torch).

A ``NativeLibrary`` compiles its sources the first time ``available()`` is asked, once per
process (thread-safe), into one module: its ops registered with torch (``ops()``,
``torch.ops.<namespace>``) and the hot ones also bound directly with pybind11 (``direct()``:
about 0.3 us a call instead of the dispatcher's 1.8), and answers False instead of raising when there is no compiler or
``LLMSERVE_CPU_KERNELS=0`` is set, so callers keep their plain-torch path. The headers' hash
is passed as a flag: torch rebuilds when a source or a flag changes, so a header change counts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def process_cxx_runtime() -> list[str]:
    """The C++ runtime this process runs on (the ``libstdc++.so`` torch loaded), to link the
    library against by name. A toolchain that offers only the static ``libstdc++.a`` (the GPU
    machine's image, seen 2026-11-29) otherwise copies iostreams and locales into the library,
    and that second copy beside the process's crashed on the first error message that formats
    a number. Empty where the process has none (another C++ runtime): the compiler's default."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    except OSError:
        return []
    return sorted(paths)[:1]


class NativeLibrary:
    """One C++ library registering torch ops under ``namespace``; ``probe_ops`` must exist."""

    def __init__(
        self,
        name: str,
        namespace: str,
        sources: list[Path],
        headers: list[Path],
        cflags: list[str],
        probe_ops: tuple[str, ...],
    ):
        self.name, self.namespace = name, namespace
        self.sources, self.headers, self.cflags = sources, headers, cflags
        self.probe_ops = probe_ops
        self._ok: bool | None = None
        self._module = None
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Whether the library is built and loaded (builds it on the first call)."""
        if self._ok is None:
            with self._lock:
                if self._ok is None:
                    self._ok = self._try_build()
        return self._ok

    def ops(self):
        """The registered ops (``torch.ops.<namespace>``), building them first if needed."""
        if not self.available():
            raise RuntimeError(f"the C++ library {self.name} is not built (the log says why)")
        return getattr(torch.ops, self.namespace)

    def direct(self):
        """The Python module of the direct bindings (the same functions as ``ops()``'s)."""
        if not self.available():
            raise RuntimeError(f"the C++ library {self.name} is not built (the log says why)")
        return self._module

    def _try_build(self) -> bool:
        if os.environ.get("LLMSERVE_CPU_KERNELS", "1") == "0":
            return False
        try:
            self._build()
        except Exception as exc:  # no compiler, failed build: callers keep plain torch
            logger.warning("C++ library %s unavailable, using plain torch: %s", self.name, exc)
            return False
        ops = getattr(torch.ops, self.namespace)
        return all(hasattr(ops, op) for op in self.probe_ops)

    def _built_before(self) -> bool:
        """Whether torch's cache holds a build of this library (torch still rebuilds it when a
        source or flag changed); True when that cannot be told."""
        try:  # torch's own cache layout (a private helper: guarded)
            from torch.utils.cpp_extension import _get_build_directory

            folder = _get_build_directory(self.name, False)
        except Exception:
            return True
        return os.path.exists(os.path.join(folder, self.name + ".so"))

    def _build(self) -> None:
        from torch.utils.cpp_extension import load

        # torch runs `ninja` from PATH; the pip-installed one sits beside this interpreter
        bin_dir = os.path.dirname(sys.executable)
        if shutil.which("ninja") is None and shutil.which("ninja", path=bin_dir):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in self.headers)).hexdigest()
        if self._built_before():
            logger.info("loading the C++ library %s (cached by torch)", self.name)
        else:  # the first start on a machine waits for this: say why
            logger.info(
                "building the C++ library %s on its first use here (about a minute on 2 "
                "cores; cached by torch after)",
                self.name,
            )
        self._module = load(
            name=self.name,
            sources=[str(p) for p in self.sources],
            # -fopenmp: at::parallel_for is an OpenMP region compiled into this library; the
            # process already has torch's libgomp loaded, which the library then shares.
            extra_cflags=["-O3", "-fopenmp", *self.cflags, f"-DLLMSERVE_HEADERS={digest[:16]}"],
            extra_ldflags=["-fopenmp", *process_cxx_runtime()],
            is_python_module=True,
            verbose=False,
        )

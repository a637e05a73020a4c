"""The processes a benchmark script starts, and the CPU they use: llmserve's commands as the
scripts run them (server, client, offline engine, on the same random batch and KV cache), a
server in a process group of its own (``Server``, a context manager that waits for it to answer
and ends the whole group), a command run to its end with its output kept (``run``), CPU seconds
read from /proc, of a process group (``group_cpu_s``) or of one thread (``thread_cpu_s``), and
a wait for process groups to go quiet (``wait_until_quiet``). Shared by side_by_side.py and
server_vs_offline.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # commands run from the repository root
KV_BYTES = 1 << 30  # every engine: 1 GiB of KV cache (vLLM: VLLM_CPU_KVCACHE_SPACE=1)
NAME = "smollm2"  # the served model's name, llmserve's and vLLM's


def llmserve_cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "llmserve.entrypoints.cli", *argv]


def llmserve_server_cli(dtype: str, port: int) -> list[str]:
    """llmserve's server as both scripts start it: the peer's name, 1 GiB of KV cache."""
    return llmserve_cli("serve", "--dtype", dtype, "--port", str(port), "--served-model-name",
                        NAME, "--kv-cache-memory", str(KV_BYTES))  # fmt: skip


def random_batch_flags(num_prompts: int, seed: int, input_len: int = 256,
                       output_len: int = 128) -> list[str]:  # fmt: skip
    """``llmserve bench``'s flags for the random batch that llmserve's client sends a server
    and the offline engine runs (server / offline divides the two)."""
    return ["--workload", "random", "--input-len", str(input_len), "--output-len",
            str(output_len), "--num-prompts", str(num_prompts), "--dataset-seed", str(seed),
            "--disable-tqdm"]  # fmt: skip


def llmserve_client_cli(url: str, batch: list[str], output_json: Path) -> list[str]:
    """llmserve's client sending ``batch`` (random_batch_flags) all at once."""
    return llmserve_cli("bench", "serve", "--base-url", url, "--served-model-name", NAME, *batch,
                        "--request-rate", "inf", "--output-json", str(output_json))  # fmt: skip


def offline_cli(dtype: str, batch: list[str], output_json: Path) -> list[str]:
    """The offline engine on ``batch`` with the server's KV cache."""
    return llmserve_cli("bench", "throughput", *batch, "--dtype", dtype, "--kv-cache-memory",
                        str(KV_BYTES), "--output-json", str(output_json))  # fmt: skip


class Server:
    """A server command in its own process group (vLLM starts an engine-core process)."""

    def __init__(self, cmd: list[str], log: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                      start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"server exited with {self._proc.returncode}; see {log}")
            try:
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=2).close()
                return
            except OSError:
                time.sleep(1)
        self.close()
        raise RuntimeError(f"server not up after 600 s; see {log}")

    @property
    def pgid(self) -> int:
        return self._proc.pid  # the leader of the session it started

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()


def run(cmd: list[str], log: Path) -> str:
    """Run a command to its end; its output goes to log and is returned."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); see {log}")
    return proc.stdout


def stat_fields(stat: Path) -> list[str] | None:
    """A /proc .../stat file's fields after the ")" closing the name (state ppid pgrp ...
    utime (12th) stime (13th)); None when the process or thread ended meanwhile."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds (user + system) one thread of a process has used so far (0 once gone)."""
    fields = stat_fields(Path(f"/proc/{pid}/task/{tid}/stat"))
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def steal_s(stat: Path = Path("/proc/stat")) -> float:
    """Seconds the hypervisor has kept this VM's CPUs from it so far, summed over the CPUs
    (the "cpu" line's 8th count, "steal"; 0 where the kernel does not report it)."""
    fields = stat.read_text().split("\n", 1)[0].split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) the processes of a process group have used so far: a
    server and its children (vLLM's engine core)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat)
        if fields is not None and int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(
    pgids: list[int], window_s: float = 1.0, busy_cpu_s: float = 0.05, timeout_s: float = 30.0
) -> float:
    """Wait until each process group uses under busy_cpu_s CPU seconds in window_s: a server
    still busy after its last run (vLLM's, measured on 2026-11-30, used 1.1 CPU s during the
    run that followed its own, 0.3 s otherwise) would take that from the next run measured.
    Gives up after timeout_s; returns the seconds waited."""
    start = time.monotonic()
    last = [group_cpu_s(pgid) for pgid in pgids]
    while time.monotonic() - start < timeout_s:
        time.sleep(window_s)
        now = [group_cpu_s(pgid) for pgid in pgids]
        if all(after - before < busy_cpu_s for before, after in zip(last, now)):
            break
        last = now
    return time.monotonic() - start

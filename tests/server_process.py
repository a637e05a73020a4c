"""Start ``llmserve serve`` as a user does (a subprocess on a free loopback port) for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 180  # model load on two busy cores
SMALL_SERVER_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "200000000"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python -m llmserve.entrypoints.cli serve ...``; waits for /health, stops with SIGTERM.
    ``env``: variables set for the server beside this process's; with ``--ssl-certfile`` the
    URL is https (the tests' self-signed certificates are not verified)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        scheme = "https" if "--ssl-certfile" in args else "http"
        self.url = f"{scheme}://{HOST}:{self.port}"
        self.log = tempfile.NamedTemporaryFile(
            prefix="llmserve-server-", suffix=".log", delete=False
        )
        command = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve"]
        command += ["--host", HOST, "--port", str(self.port), *args]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, verify=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.logs()}")

    def logs(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the server and wait for it; returns its exit code (kills it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def close(self) -> None:
        """Stop the server and delete its log."""
        self.stop()
        self.log.close()
        os.unlink(self.log.name)

    def metrics(self) -> dict[str, float]:
        """The /metrics samples, ``name{labels}`` -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def wait_for_metric(self, name: str, predicate, timeout: float = 30) -> float:
        """Poll /metrics until ``predicate(value)``; returns the last value seen."""
        deadline = time.monotonic() + timeout
        value = self.metrics().get(name)
        while not (value is not None and predicate(value)) and time.monotonic() < deadline:
            time.sleep(0.2)
            value = self.metrics().get(name)
        return value

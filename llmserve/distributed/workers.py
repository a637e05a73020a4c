"""Ranks 1..N-1 of a tensor-parallel engine as local processes, and how they start.

As vLLM's ``VLLM_WORKER_MULTIPROC_METHOD``: ``LLMSERVE_WORKER_MULTIPROC_METHOD=spawn`` (the
default: a fresh interpreter per worker, which imports torch and transformers again, about
5 s on a slow 2-core host) or ``forkserver`` (one server process, started with the worker's
module imported, forks each worker: engines created one after another in a process, as tests
and notebooks do, start their workers in well under a second after the first; the server
keeps running, and keeps the environment it started with). ``fork`` is not offered: a forked
OpenMP runtime hangs in its first parallel region.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
from collections.abc import Callable

import torch.multiprocessing as mp

from llmserve.distributed import process_group as pg

START_TIMEOUT_S = 600.0  # a worker reading a large checkpoint
START_METHOD_ENV = "LLMSERVE_WORKER_MULTIPROC_METHOD"
START_METHODS = ("spawn", "forkserver")


def start_context(preload: str):
    """The multiprocessing context of ``LLMSERVE_WORKER_MULTIPROC_METHOD`` (module doc)."""
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in START_METHODS:
        raise ValueError(
            f"{START_METHOD_ENV}={method!r} is not a start method for tensor-parallel workers; "
            f"choose one of {', '.join(START_METHODS)}"
        )
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([preload])  # imported once, before the server's first fork
    return ctx


class WorkerSet:
    """Ranks 1..N-1 as local processes (daemons: they end with the engine process)."""

    def __init__(self, info: pg.RankInfo, args: tuple, target: Callable) -> None:
        """``target(rank_info, args, status)`` runs in each worker and puts ``(rank, None)``
        (ready) or ``(rank, traceback text)`` on ``status``."""
        ctx = start_context(target.__module__)
        self.status = ctx.Queue()
        self.processes = []
        for rank in range(1, info.world_size):
            rank_info = dataclasses.replace(info, rank=rank, local_rank=rank)
            p = ctx.Process(
                target=target,
                args=(rank_info, args, self.status),
                daemon=True,
                name=f"llmserve-tp-rank{rank}",
            )
            p.start()
            self.processes.append(p)

    def wait_ready(self) -> None:
        pending = {p.pid for p in self.processes}
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending and time.monotonic() < deadline:
            try:
                rank, error = self.status.get(timeout=0.2)
            except queue.Empty:
                self.check_alive()
                continue
            if error is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{error}")
            pending.discard(self.processes[rank - 1].pid)
        if pending:
            raise RuntimeError(f"tensor-parallel workers did not start in {START_TIMEOUT_S:.0f} s")

    def check_started(self) -> None:
        """Raise a worker's start-up error, or its death, without waiting."""
        try:
            rank, error = self.status.get_nowait()
        except queue.Empty:
            self.check_alive()
            return
        if error is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{error}")
        self.status.put((rank, None))  # a "ready": leave it for wait_ready

    def check_alive(self) -> None:
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) died with exit code "
                    f"{p.exitcode}; restart the engine"
                )

    def join(self, timeout: float = 10.0) -> None:
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.terminate()

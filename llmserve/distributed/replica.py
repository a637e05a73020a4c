"""One data-parallel replica and what the front end needs beside it: the Ray actor that runs
an engine (``ReplicaActor``), its slot in the server (``Replica``) and the Ray connection
(``connect_ray``); the model-less view of the engine the HTTP layer reads is
``engine/frontend.py``'s ``EngineFrontend``.
``data_parallel.py`` routes requests over them."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from llmserve.engine.async_engine import EngineSnapshot
from llmserve.engine.request_stream import RequestStream
from llmserve.sampling_params import SamplingParams

RAY_CONNECT_TIMEOUT_S = 5.0


class RequestAborted(Exception):
    """Ends a replica's ``generate`` when the server aborted the request."""


class ReplicaActor:
    """One engine replica (wrapped by ``ray.remote``): an ``AsyncLLMEngine`` on its own loop."""

    def __init__(self, engine_kwargs: dict[str, Any], max_num_waiting: int | None) -> None:
        from llmserve.engine.async_engine import AsyncLLMEngine
        from llmserve.engine.llm_engine import LLMEngine

        self.engine = AsyncLLMEngine.build(
            lambda: LLMEngine.from_kwargs(**engine_kwargs), max_num_waiting
        )
        self.streams: dict[str, RequestStream] = {}  # so that abort can end a stream

    def _ensure_started(self) -> None:
        if not self.engine.is_alive:
            self.engine.start()

    async def describe(self) -> dict[str, Any]:
        self._ensure_started()
        engine = self.engine.engine
        return {
            "pid": os.getpid(),
            "model_name": engine.model_name,
            "max_model_len": engine.max_model_len,
            "kv_info": engine.kv_info,
        }

    async def generate(self, request_id: str, prompt, params: SamplingParams, priority: int):
        """Yields None once admitted (a refusal raises first), then the cumulative outputs."""
        self._ensure_started()
        stream = await self.engine.add_request(request_id, prompt, params, priority)
        self.streams[request_id] = stream
        yield None
        try:
            while not stream.is_finished:
                yield await stream.get()
        except RequestAborted:
            return
        finally:
            self.streams.pop(request_id, None)
            if not stream.is_finished:
                self.engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort in the engine and end the request's ``generate`` (the caller is gone)."""
        self.engine.abort(request_id)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.put(RequestAborted(request_id))

    async def snapshot(self) -> tuple[EngineSnapshot, int]:
        self._ensure_started()
        return self.engine.snapshot, self.engine.num_waiting


@dataclass
class Replica:
    """One actor slot: replaced by a fresh actor when the old one dies."""

    index: int
    actor: Any = None
    pid: int | None = None
    is_healthy: bool = False
    num_restarts: int = 0
    snapshot: EngineSnapshot = dataclasses.field(default_factory=EngineSnapshot)
    num_waiting: int = 0


def connect_ray(address: str | None) -> Any:
    """``ray.init`` on a local instance (no address) or a cluster; refuse an unreachable one
    before Ray spends minutes retrying."""
    try:
        import ray
    except ImportError as e:
        raise ValueError(
            "data-parallel serving needs Ray: pip install 'llmserve[ray]' (or pip install ray)"
        ) from e
    if address not in (None, "auto", "local"):
        host_port = address.removeprefix("ray://")
        host, _, port = host_port.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--ray-address {address!r}: expected host:port or ray://host:port")
        try:
            socket.create_connection((host, int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise ValueError(
                f"cannot reach the Ray cluster at {address!r} ({e}); is `ray start --head` "
                "running there, and is the port open?"
            ) from e
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    return ray

"""The server's side of the engine-core process (``core_process.py`` has the picture):
``EngineCoreClient`` has the interface of ``AsyncLLMEngine`` that the server uses (requests,
streams, snapshot, listeners, lifecycle), so the HTTP layers do not know where the model runs.

The server process keeps an ``EngineFrontend`` (tokenizer, config, grammars) and tokenizes
prompts before they go to the core. A writer thread sends the handlers' messages (so that
``begin_shutdown`` may be called from a signal handler: it only queues one); a reader thread
receives the core's, rebuilds outputs from their deltas and hands them to the event loop. If
the core process dies, every request in flight ends with ``EngineStepError`` and /health
answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from llmserve.engine.async_engine import (
    EngineClosedError,
    EngineListeners,
    EngineSnapshot,
    EngineStepError,
    check_can_add,
    check_streamable,
    stream_outputs,
)
from llmserve.engine.core_process import run_engine_core
from llmserve.engine.frontend import EngineFrontend
from llmserve.engine.llm_engine import prompt_cache_salt
from llmserve.engine.output_deltas import OutputDecoder
from llmserve.engine.request_stream import RequestStream
from llmserve.lora.request import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class EngineCoreClient:
    """``AsyncLLMEngine``'s server-facing interface over an engine core in a child process."""

    def __init__(self, config: Any, max_num_waiting: int | None = None) -> None:
        """Start the core process and wait until it has loaded the model (its errors raise
        here, as ``AsyncLLMEngine.build``'s do)."""
        self.engine = EngineFrontend.load(config)  # a bad model path fails here, first
        self.max_num_waiting = max_num_waiting
        self.listeners = EngineListeners()
        self.snapshot = EngineSnapshot()
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=run_engine_core,
            args=(config, child_conn, logging.getLogger().getEffectiveLevel()),
            name="llmserve-engine-core",
        )
        self._process.start()
        child_conn.close()
        try:
            kind, info = pickle.loads(self._conn.recv_bytes())
        except EOFError:
            self._process.join()
            raise RuntimeError(
                f"the engine-core process exited with code {self._process.exitcode} while "
                "loading the model; its log is above"
            ) from None
        if kind == "failed":
            self._process.join()
            raise info
        self.engine.model_name = info["model_name"]
        self.engine.max_model_len = info["max_model_len"]
        self.engine.kv_info = info["kv_info"]
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._adding: dict[str, asyncio.Future[None]] = {}
        self._decoder = OutputDecoder()  # reader thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_accepting = True
        self._core_exited = False
        self._threads = [
            threading.Thread(target=self._write, name="llmserve-core-writer", daemon=True),
            threading.Thread(target=self._read, name="llmserve-core-reader", daemon=True),
        ]

    # ---- lifecycle (the server's lifespan) ----------------------------------------------
    def start(self) -> None:
        """Start the pipe's threads; call from the event loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        for thread in self._threads:
            thread.start()

    def begin_shutdown(self) -> None:
        """Refuse new requests; the core ends those in flight with finish_reason "abort".
        Safe to call from a signal handler: it sets a flag and queues a message."""
        self._is_accepting = False
        self._outbox.put(("shutdown",))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Abort everything, end the core process and the pipe's threads."""
        self.begin_shutdown()
        self._outbox.put(("stop",))
        if not self._threads[0].is_alive():  # never started: send it here
            self._write()
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine-core process did not stop in %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join()
        self._outbox.put(None)
        self._conn.close()

    @property
    def is_alive(self) -> bool:
        return self._loop is not None and not self._core_exited and self._process.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the core's scheduler or on their way to it."""
        return self.snapshot.num_requests_waiting + len(self._adding)

    # ---- requests (event loop) ----------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request; raises ValueError (cannot fit), EngineOverloaded, EngineClosed."""
        check_streamable(params)
        self._check_can_add()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.engine.prompt_token_ids(prompt)
        salt = prompt_cache_salt(prompt)  # the core's engine checks it again
        prompt = {"prompt": text, "prompt_token_ids": token_ids, "cache_salt": salt}
        stream = RequestStream(request_id)
        added = asyncio.get_running_loop().create_future()
        self._streams[request_id] = stream  # before the add: no output can miss it
        self._adding[request_id] = added
        self._outbox.put(
            ("add", request_id, prompt, params, priority, time.monotonic(), lora_request)
        )
        try:
            await added
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it runs after it
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._adding.pop(request_id, None)
        return stream

    def generate(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``AsyncLLMEngine.generate``: the request's cumulative outputs."""
        return stream_outputs(self, request_id, prompt, params, priority, lora_request)

    def abort(self, request_id: str) -> None:
        """Abort a request; its final output still comes back (for the metrics)."""
        self._streams.pop(request_id, None)
        self._outbox.put(("abort", request_id))

    def _check_can_add(self) -> None:
        if self._core_exited:
            raise EngineClosedError(
                f"the engine-core process exited (code {self._process.exitcode}); the server "
                "takes no requests until it is restarted"
            )
        check_can_add(self._is_accepting and self.is_alive, self.num_waiting, self.max_num_waiting)

    # ---- the pipe's threads -------------------------------------------------------------
    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:  # the core is gone (the reader reports it)
                return
            if message[0] == "stop":
                return

    def _read(self) -> None:
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            if message[0] == "step":
                _, num_seqs, payload = message
                outputs = [
                    (rid, item if isinstance(item, BaseException) else self._decoder.decode(item))
                    for rid, item in payload
                ]
                message = ("step", num_seqs, outputs)
            self._to_loop(self._on_message, message)
        self._to_loop(self._on_core_exit)

    def _to_loop(self, callback, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(callback, *args)
            except RuntimeError:  # the loop closed meanwhile
                pass

    # ---- the core's messages (event loop) -----------------------------------------------
    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            self._on_step(message[1], message[2])
        elif kind == "snapshot":
            self.snapshot = message[1]
        elif kind == "added":
            added = self._adding.get(message[1])
            if added is not None and not added.done():
                if message[2] is None:
                    added.set_result(None)
                else:
                    added.set_exception(message[2])

    def _on_step(self, num_seqs: int, outputs: list[tuple[str, Any]]) -> None:
        if num_seqs:
            for callback in self.listeners.on_step:
                callback(num_seqs)
        for rid, item in outputs:
            stream = self._streams.get(rid)
            if isinstance(item, BaseException):
                self._streams.pop(rid, None)
            elif item.finished:
                self._streams.pop(rid, None)
                self.listeners.notify_finish(item)
            if stream is not None:
                stream.put(item)

    def _on_core_exit(self) -> None:
        """The pipe closed: after "stop", or because the core process died."""
        self._core_exited = True
        if not self._is_accepting and not self._streams:
            return
        self._process.join(1.0)
        error = EngineStepError(
            f"the engine-core process exited (code {self._process.exitcode}) during this request"
        )
        if self._is_accepting:
            logger.error("the engine-core process exited with code %s", self._process.exitcode)
        for added in self._adding.values():
            if not added.done():
                added.set_exception(EngineClosedError(str(error)))
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()

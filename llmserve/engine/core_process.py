"""The engine core in a process of its own: the model, the KV cache and the step loop, away
from the server's HTTP work (vLLM's design; ``llmserve serve --engine-core-process``).

    server process                              engine-core process
    --------------                              -------------------
    EngineCoreClient (core_client.py)           EngineCore: AsyncLLMEngine's loop, on the
      event loop: HTTP, SSE, tokenizer            process's main thread (it loaded the model)
      writer thread  --("add" | "abort" |  -->  command thread -> the loop's command queue
                        "shutdown" | "stop")
      reader thread  <--("added", id, error)--  after each add
                     <--("step", seqs, deltas)  after each step: outputs as deltas
                     <--("snapshot", ...)----   counters for /metrics, after each loop turn

In one process the HTTP handlers and the engine share the GIL: a streamed chunk the event
loop writes can make the engine thread wait for the GIL between two kernels. Here the
server's CPU time only competes for the cores. Measured on a 2-core AMD Zen 5 host (bf16,
64 requests of 256/128 at once, docs/bench/journal.md), that made no difference to throughput:
the server's decode steps ran 7-19% longer than the same steps offline in either design, so
the GIL is not what slows them there; the thread stays the default (measured twice since,
either ahead by 1-3%: inside the VM's spread). A core that crashes
leaves the HTTP server up (/health answers 503), and the server's Python never pauses the
engine's.

Messages are pickled over one ``multiprocessing`` pipe. Outputs travel as deltas
(``output_deltas.py``); the server rebuilds each ``RequestOutput``. Prompts arrive tokenized.
An abort always sends the request's final output back (the server's metrics count it), even
where no one reads the stream any more. The process ends on "stop", or when the server's end
of the pipe closes (the server died).
"""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from llmserve.engine.async_engine import AsyncLLMEngine
from llmserve.engine.output_deltas import OutputEncoder
from llmserve.engine.request_stream import RequestStream
from llmserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


def run_engine_core(config: Any, conn: Connection, log_level: int) -> None:
    """The engine-core process's main: load the model, say "ready" (or why it failed), serve."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server ends it (Ctrl-C reaches both)
        signal.signal(sig, signal.SIG_IGN)
    from llmserve.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - the server re-raises it
        conn.send_bytes(pickle.dumps(("failed", _picklable(e))))
        return
    core = EngineCore(engine, conn)
    info = {"model_name": engine.model_name, "max_model_len": engine.max_model_len}
    conn.send_bytes(pickle.dumps(("ready", info | {"kv_info": engine.kv_info})))
    threading.Thread(target=core.read_commands, name="llmserve-core-commands", daemon=True).start()
    core.run_here()


class EngineCore(AsyncLLMEngine):
    """``AsyncLLMEngine`` whose requests come from, and whose outputs go to, the pipe."""

    def __init__(self, engine: Any, conn: Connection) -> None:
        super().__init__(engine)  # the server checks --max-num-waiting
        self._conn = conn
        self._send_lock = threading.Lock()
        self._encoder = OutputEncoder()
        self._beams: set[str] = set()  # requests whose outputs do not only grow
        self._num_seqs = 0
        self.listeners.on_step.append(self._count_seqs)

    def run_here(self) -> None:
        """Run the loop on this thread, the one that loaded the model."""
        self._thread = threading.current_thread()
        self._may_run.set()
        self._run()

    def read_commands(self) -> None:
        """The command thread: the server's messages, as commands for the loop."""
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):  # the server is gone: end
                message = ("stop",)
            kind = message[0]
            if kind == "add":
                self._queue_add(*message[1:])
            elif kind == "abort":
                self.abort(message[1])
            elif kind == "shutdown":
                self.begin_shutdown()
            elif kind == "stop":
                self.begin_shutdown()
                self._commands.put(self._set_stopped)
                return

    def _queue_add(
        self, request_id: str, prompt, params, priority: int, arrival: float, lora=None
    ) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.add_done_callback(lambda f: self._send(("added", request_id, _error_of(f))))
        if params.use_beam_search:
            self._beams.add(request_id)
        stream = RequestStream(request_id)  # a key only: outputs go to the pipe
        self._submit_add(stream, prompt, params, priority, arrival, done, lora)

    # ---- the loop's hand-offs, to the pipe instead of an event loop -------------------------
    def _abort(self, request_id: str, deliver: bool) -> None:
        super()._abort(request_id, deliver=True)  # the server's metrics see every end

    def _count_seqs(self, num_seqs: int) -> None:
        self._num_seqs += num_seqs

    def _deliver(self, items: list[tuple[RequestStream, RequestOutput | Exception]]) -> None:
        num_seqs, self._num_seqs = self._num_seqs, 0
        if not items and not num_seqs:
            return
        payload = []
        for stream, item in items:
            rid = stream.request_id
            if isinstance(item, RequestOutput):
                payload.append((rid, self._encoder.encode(item, rid not in self._beams)))
                if item.finished:
                    self._beams.discard(rid)
            else:
                self._encoder.forget(rid)
                self._beams.discard(rid)
                payload.append((rid, _picklable(item)))
        self._send(("step", num_seqs, payload))

    def _take_snapshot(self) -> None:
        super()._take_snapshot()
        self._send(("snapshot", self.snapshot))

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError:  # the server is gone; the command thread stops the loop
            pass


def _error_of(done: concurrent.futures.Future) -> BaseException | None:
    error = done.exception()
    return None if error is None else _picklable(error)


def _picklable(error: BaseException) -> BaseException:
    """The error itself where it pickles, else a RuntimeError with its text."""
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")

"""The engine loop in a background thread, with one asyncio output stream per request.

    HTTP handler (event loop)            engine thread
    -------------------------            -------------
    await add_request(...)  --command-->  engine.add_request (ValueError goes back)
    async for out in stream  <--outputs--  engine.step() -> RequestOutputs, every step
    abort(request_id)       --command-->  engine.abort_request, blocks freed before next step

Only the engine thread touches ``LLMEngine``; handlers talk to it through a command queue,
so every forward step batches whatever requests are alive. A failing step is logged, the
requests that step ran get the error, and the loop carries on serving the others.

Build the engine with ``AsyncLLMEngine.build(make_engine)`` so that the thread that loads the
model is the thread that steps it. OpenMP (libgomp, under torch's CPU ops) keeps a pool of
threads per thread that runs parallel regions; once a second thread runs torch ops, the
process holds more OpenMP threads than cores and libgomp stops spin-waiting at its barriers.
A model loaded on the main thread and stepped on another ran 25-35% slower on 2 cores
(bf16 offline, 64 x 256/128: 707 tok/s on one thread, 521 across two).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from llmserve.engine.llm_engine import LLMEngine, PromptType
from llmserve.engine.request_stream import RequestStream
from llmserve.lora.request import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from llmserve.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # how long the idle engine thread sleeps on the command queue


class EngineOverloadedError(RuntimeError):
    """Too many requests wait already; the caller should retry later."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down (or its thread died) and takes no new requests."""


class EngineStepError(RuntimeError):
    """A forward step failed while this request was in flight."""


class ReplicaDiedError(RuntimeError):
    """A data-parallel replica died while this request was in flight (it is being restarted)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Counters and gauges, copied by the engine thread after every step."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    num_steps: int = 0
    max_batched_seqs: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # a copy


@dataclass
class EngineListeners:
    """Callbacks run on the engine thread: ``on_step(num_seqs)``, ``on_finish(output)``."""

    on_step: list[Callable[[int], None]] = field(default_factory=list)
    on_finish: list[Callable[[RequestOutput], None]] = field(default_factory=list)

    def notify_finish(self, output: RequestOutput) -> None:
        """Run every ``on_finish`` callback; one that fails is logged, the others still run."""
        for callback in self.on_finish:
            try:
                callback(output)
            except Exception:
                logger.exception("on_finish listener failed")


class AsyncLLMEngine:
    """Drives ``LLMEngine.step`` in a thread; ``generate`` yields cumulative outputs."""

    def __init__(self, engine: LLMEngine, max_num_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_num_waiting = max_num_waiting
        self.listeners = EngineListeners()
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._num_pending_adds = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._is_accepting = True
        self._is_stopped = False
        self._may_run = threading.Event()  # set by start (or stop): the loop may begin

    @classmethod
    def build(
        cls, make_engine: Callable[[], LLMEngine], max_num_waiting: int | None = None
    ) -> AsyncLLMEngine:
        """Start the engine thread, build the engine on it (its errors raise here), and keep
        that thread waiting for ``start`` to run the loop (see the module docstring)."""
        ready: concurrent.futures.Future[AsyncLLMEngine] = concurrent.futures.Future()

        def engine_thread() -> None:
            try:
                async_engine = cls(make_engine(), max_num_waiting)
            except BaseException as e:  # noqa: BLE001 - handed to the caller of build
                ready.set_exception(e)
                return
            async_engine._thread = threading.current_thread()
            ready.set_result(async_engine)
            async_engine._may_run.wait()
            async_engine._run()

        threading.Thread(target=engine_thread, name="llmserve-engine", daemon=True).start()
        return ready.result()

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        if self._thread is None:  # built on this thread: step it on a new one
            self._thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)
            self._thread.start()
        self._may_run.set()

    def begin_shutdown(self) -> None:
        """Refuse new requests and end those in flight with finish_reason "abort".

        Safe to call from a signal handler: it only sets a flag and queues a command.
        """
        self._is_accepting = False
        self._commands.put(self._abort_all)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and join the engine thread."""
        self.begin_shutdown()
        self._commands.put(self._set_stopped)
        self._may_run.set()  # a built engine that never started ends, too
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._may_run.is_set() and self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the scheduler plus those not yet handed to it."""
        return self.snapshot.num_requests_waiting + self._num_pending_adds

    # ---- requests (event loop side) -----------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request; raises ValueError (cannot fit), EngineOverloaded, EngineClosed."""
        check_streamable(params)
        self._check_can_add()
        stream = RequestStream(request_id)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        arrival_time = time.monotonic()
        self._submit_add(stream, prompt, params, priority, arrival_time, done, lora_request)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it runs after it
            raise
        return stream

    def generate(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs; closing the generator early aborts the
        request (wrap it in ``contextlib.aclosing`` to close it on ``break``)."""
        return stream_outputs(self, request_id, prompt, params, priority, lora_request)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""
        self._commands.put(lambda: self._abort(request_id, deliver=False))

    def _check_can_add(self) -> None:
        check_can_add(self._is_accepting and self.is_alive, self.num_waiting, self.max_num_waiting)

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        with self.engine.compute_threads_bound():  # this thread steps the model for good
            while not self._is_stopped:
                try:
                    self._run_commands(block=not self.engine.has_unfinished_requests())
                    if self.engine.has_unfinished_requests() and not self._is_stopped:
                        self._step()
                    self._take_snapshot()
                except Exception:  # keep serving; _step already contains model failures
                    logger.exception("engine loop error")
                    time.sleep(_IDLE_POLL_S)

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else None
        except queue.Empty:
            return
        while True:
            if command is not None:
                try:
                    command()
                except Exception:  # a command must never take the loop down
                    logger.exception("engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _submit_add(self, *add_args: Any) -> None:
        """Count an add as pending and queue ``_add(*add_args)`` for the engine thread (from
        any thread)."""
        with self._lock:
            self._num_pending_adds += 1
        self._commands.put(lambda: self._add(*add_args))

    def _add(
        self,
        stream: RequestStream,
        prompt: PromptType,
        params: SamplingParams,
        priority: int,
        arrival_time: float,
        done: concurrent.futures.Future[None],
        lora_request: LoRARequest | None = None,
    ) -> None:
        with self._lock:
            self._num_pending_adds -= 1
        if done.set_running_or_notify_cancel() is False:
            return
        try:
            if not self._is_accepting:
                raise EngineClosedError("the server is shutting down and takes no new requests")
            self.engine.add_request(
                stream.request_id, prompt, params, priority, arrival_time, lora_request=lora_request
            )
        except Exception as e:  # ValueError for the caller; anything else, too
            done.set_exception(e)
            return
        self._streams[stream.request_id] = stream
        done.set_result(None)

    def _abort(self, request_id: str, deliver: bool) -> None:
        """Abort in the engine; with ``deliver``, the stream gets a final "abort" output."""
        stream = self._streams.pop(request_id, None)
        outputs = self.engine.abort_request(request_id)
        if not outputs or stream is None:
            return
        output = outputs[0]
        self.listeners.notify_finish(output)
        if deliver:
            self._deliver([(stream, output)])

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id, deliver=True)

    def _set_stopped(self) -> None:
        self._is_stopped = True

    def _step(self) -> None:
        num_steps, num_seqs = self.engine.stats.num_steps, self.engine.stats.num_batched_seqs
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; ending the requests it ran")
            self._fail_running(e)
            return
        if self.engine.stats.num_steps > num_steps:
            for callback in self.listeners.on_step:
                callback(self.engine.stats.num_batched_seqs - num_seqs)
        ready = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                self.listeners.notify_finish(output)
            ready.append((stream, output))
        self._deliver(ready)

    def _fail_running(self, error: Exception) -> None:
        """End the requests the failed step ran; those still waiting stay queued."""
        failure = EngineStepError(f"the engine failed during this request: {error}")
        scheduler = self.engine.scheduler
        failed_ids = {seq.request.request_id for seq in scheduler.running}
        failed_ids |= {rid for rid in self._streams if rid not in scheduler.requests}
        self.engine.abort_request(sorted(failed_ids))
        failed = [self._streams.pop(rid) for rid in failed_ids if rid in self._streams]
        self._deliver([(stream, failure) for stream in failed])

    def _deliver(self, items: list[tuple[RequestStream, RequestOutput | Exception]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, items)

    def _take_snapshot(self) -> None:
        engine = self.engine
        scheduler, blocks = engine.scheduler, engine.block_manager
        self.snapshot = EngineSnapshot(
            num_requests_running=len({s.request.request_id for s in scheduler.running}),
            num_requests_waiting=len({s.request.request_id for s in scheduler.waiting}),
            kv_cache_usage=blocks.usage,
            num_preemptions=scheduler.num_preemptions,
            num_prompt_tokens=engine.stats.num_prompt_tokens,
            num_generation_tokens=engine.stats.num_generation_tokens,
            num_prefix_queries=blocks.num_prefix_queries,
            num_prefix_hits=blocks.num_prefix_hits,
            num_steps=engine.stats.num_steps,
            max_batched_seqs=engine.stats.max_batched_seqs,
            spec_decode=copy.deepcopy(engine.spec_stats),
        )


async def stream_outputs(
    engine: Any,
    request_id: str,
    prompt: PromptType,
    params: SamplingParams,
    priority: int,
    lora_request: LoRARequest | None = None,
) -> AsyncIterator[RequestOutput]:
    """``generate`` of every engine the server drives (this one, the engine-core client, the
    data-parallel router): add the request, yield its outputs, abort it if closed early."""
    stream = await engine.add_request(request_id, prompt, params, priority, lora_request)
    try:
        while not stream.is_finished:
            yield await stream.get()
    finally:
        if not stream.is_finished:
            engine.abort(request_id)


def check_can_add(is_open: bool, num_waiting: int, max_num_waiting: int | None) -> None:
    """Refuse a new request while the engine is closed or too many requests wait."""
    if not is_open:
        raise EngineClosedError("the server is shutting down and takes no new requests")
    if max_num_waiting is not None and num_waiting >= max_num_waiting:
        raise EngineOverloadedError(
            f"{num_waiting} requests are waiting already (--max-num-waiting "
            f"{max_num_waiting}); retry later"
        )


def check_streamable(params: SamplingParams) -> None:
    """A RequestStream keeps a request's newest output, so each must hold all before it."""
    if params.output_kind is RequestOutputKind.DELTA:
        raise ValueError(
            "output_kind DELTA is not supported by the async engine: a request's stream keeps "
            "its newest output, which must be cumulative; use CUMULATIVE (the default) or "
            "FINAL_ONLY"
        )


def _put_all(items: list[tuple[RequestStream, RequestOutput | Exception]]) -> None:
    for stream, item in items:
        stream.put(item)

"""AsyncLLMEngine on a stub engine (real scheduler and block manager, fake tokens, no model).

Concurrent requests share steps; a refused request, an abort, a failing step and a shutdown
each end the right requests and leave the engine serving, with no KV block leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from llmserve.config import SchedulerConfig
from llmserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineClosedError,
    EngineOverloadedError,
    EngineStepError,
    RequestStream,
)
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.llm_engine import EngineStats
from llmserve.engine.output_processor import make_request_output
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sequence import FinishReason
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from tests.fake_engine import make_request

TIMEOUT_S = 30


class StubEngine:
    """The part of LLMEngine that AsyncLLMEngine uses; every step samples token 7."""

    def __init__(self):
        self.block_manager = BlockManager(64, 4)
        self.scheduler = Scheduler(SchedulerConfig(), self.block_manager)
        self.stats = EngineStats()
        self.fail_next_step = False
        self.step_gate = threading.Event()  # cleared: the next step waits
        self.step_gate.set()
        self.pause_after_steps: int | None = None  # clear the gate after this many steps

    def add_request(
        self, request_id, prompt, params, priority=0, arrival_time=None, lora_request=None
    ):
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        request = make_request(request_id, len(prompt), params.max_tokens, params.n, prompt=prompt)
        self.scheduler.add(request)
        return request

    def abort_request(self, request_ids):
        outputs = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None and self.scheduler.abort(request_id):
                outputs.append(make_request_output(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def compute_threads_bound(self):
        return contextlib.nullcontext()  # no model: no compute threads to pin

    def step(self) -> list[RequestOutput]:
        self.step_gate.wait(TIMEOUT_S)
        if self.pause_after_steps is not None:
            self.pause_after_steps -= 1
            if self.pause_after_steps == 0:
                self.step_gate.clear()
        out = self.scheduler.schedule()
        if self.fail_next_step:  # as if the model runner raised
            self.fail_next_step = False
            raise RuntimeError("boom")
        self.stats.num_steps += 1
        self.stats.num_batched_seqs += len(out.scheduled)
        self.stats.max_batched_seqs = max(self.stats.max_batched_seqs, len(out.scheduled))
        samples = {
            s.seq.seq_id: [(7, None)] * s.num_samples for s in out.scheduled if s.num_samples
        }
        changed = {}
        for sampled in self.scheduler.update(out, samples):
            seq = sampled.seq
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                self.scheduler.finish(seq, FinishReason.LENGTH)
            changed[seq.request.request_id] = seq.request
        return [make_request_output(r) for r in changed.values()]


def run(coro_fn, max_num_waiting=None):
    """Run ``coro_fn(async_engine, stub)`` on a started engine; check no block leaked."""
    stub = StubEngine()

    async def main():
        engine = AsyncLLMEngine(stub, max_num_waiting=max_num_waiting)
        engine.start()
        try:
            return await asyncio.wait_for(coro_fn(engine, stub), TIMEOUT_S)
        finally:
            stub.step_gate.set()
            await asyncio.to_thread(engine.stop)

    result = asyncio.run(main())
    assert not stub.has_unfinished_requests()
    stub.block_manager.check_idle()
    return result


async def final(engine, request_id, prompt=(1, 2, 3), max_tokens=4) -> RequestOutput:
    params = SamplingParams(max_tokens=max_tokens)
    outputs = [o async for o in engine.generate(request_id, list(prompt), params)]
    return outputs[-1]


def _output(num_tokens: int, finished: bool = False) -> RequestOutput:
    tokens = list(range(num_tokens))
    completion = CompletionOutput(
        0, "x" * num_tokens, tokens, finish_reason="length" if finished else None
    )
    return RequestOutput("r", None, [1], [completion], finished=finished)


def test_request_stream_skips_to_the_newest_output_and_keeps_an_error():
    async def body():
        stream = RequestStream("r")
        waiting = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing yet: get waits
        stream.put(_output(1))
        assert len((await waiting).outputs[0].token_ids) == 1
        stream.put(_output(2))
        stream.put(_output(3))  # a reader that fell behind gets only the newest
        assert len((await stream.get()).outputs[0].token_ids) == 3
        stream.put(_output(4))
        stream.put(EngineStepError("boom"))
        stream.put(_output(5))  # an error is final: later outputs do not replace it
        for _ in range(2):
            with pytest.raises(EngineStepError, match="boom"):
                await stream.get()
        assert stream.is_finished

    asyncio.run(body())


def test_request_stream_finishes_with_its_last_output():
    async def body():
        stream = RequestStream("r")
        stream.put(_output(1))
        stream.put(_output(2, finished=True))
        output = await stream.get()
        assert output.finished and stream.is_finished

    asyncio.run(body())


def test_concurrent_requests_share_steps():
    async def body(engine, stub):
        outputs = await asyncio.gather(*(final(engine, f"r{i}") for i in range(8)))
        assert all(o.finished and o.outputs[0].token_ids == [7] * 4 for o in outputs)
        assert stub.stats.max_batched_seqs > 1

    run(body)


def test_delta_outputs_are_refused_and_others_go_on():
    """A stream keeps the newest output only: deltas would be lost, so they are refused."""

    async def body(engine, stub):
        params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)
        with pytest.raises(ValueError, match="DELTA is not supported"):
            await engine.add_request("delta", [1, 2, 3], params)
        assert (await final(engine, "good")).finished

    run(body)


def test_refused_request_raises_and_others_go_on():
    async def body(engine, stub):
        with pytest.raises(ValueError, match="empty"):
            await final(engine, "bad", prompt=())
        assert (await final(engine, "good")).finished

    run(body)


def test_leaving_the_stream_aborts_the_request():
    async def body(engine, stub):
        stub.pause_after_steps = 1
        params = SamplingParams(max_tokens=50)
        async with contextlib.aclosing(engine.generate("long", [1, 2, 3], params)) as outputs:
            async for output in outputs:
                assert not output.finished
                break
        stub.step_gate.set()
        await final(engine, "after")  # queued after the abort command
        assert "long" not in stub.scheduler.requests

    run(body)


def test_failing_step_fails_only_the_requests_it_ran():
    async def body(engine, stub):
        stub.step_gate.clear()
        tasks = [asyncio.ensure_future(final(engine, f"r{i}", max_tokens=20)) for i in range(2)]
        await asyncio.sleep(0.1)
        stub.fail_next_step = True
        stub.step_gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[0], EngineStepError)  # r0 was in the failed step
        assert all(isinstance(r, EngineStepError) or r.finished for r in results), results
        assert (await final(engine, "later")).finished

    run(body)


def test_too_many_waiting_is_overloaded():
    async def body(engine, stub):
        stub.step_gate.clear()  # the engine thread stalls inside its first step
        first = asyncio.ensure_future(final(engine, "first"))
        await asyncio.sleep(0.1)
        queued = asyncio.ensure_future(final(engine, "queued"))
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloadedError, match="max-num-waiting"):
            await engine.add_request("refused", [1], SamplingParams())
        stub.step_gate.set()
        assert (await first).finished and (await queued).finished

    run(body, max_num_waiting=1)


def test_shutdown_ends_streams_with_abort_and_refuses_new_requests():
    async def body(engine, stub):
        stream = await engine.add_request("inflight", [1, 2], SamplingParams(max_tokens=500))
        engine.begin_shutdown()
        output = await stream.get()
        while not output.finished:
            output = await stream.get()
        assert output.outputs[0].finish_reason == "abort"
        with pytest.raises(EngineClosedError):
            await engine.add_request("new", [1], SamplingParams())

    run(body)


def test_built_engine_is_loaded_and_stepped_on_one_thread():
    """``build`` runs the factory on the engine thread, which later runs every step (OpenMP
    pools per thread: see async_engine's docstring)."""
    threads = {}

    class RecordingStub(StubEngine):
        def __init__(self):
            threads["built"] = threading.current_thread()
            super().__init__()

        def step(self):
            threads.setdefault("stepped", set()).add(threading.current_thread())
            return super().step()

    engine = AsyncLLMEngine.build(RecordingStub)
    assert not engine.is_alive  # waits for start

    async def main():
        engine.start()
        try:
            return await asyncio.wait_for(final(engine, "r"), TIMEOUT_S)
        finally:
            await asyncio.to_thread(engine.stop)

    assert asyncio.run(main()).finished
    assert threads["built"] is not threading.main_thread()
    assert threads["stepped"] == {threads["built"]}
    assert not threads["built"].is_alive()


def test_build_raises_the_factory_error_and_a_built_engine_stops_unstarted():
    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLMEngine.build(broken)
    engine = AsyncLLMEngine.build(StubEngine)
    engine.stop()
    assert not engine._thread.is_alive()

"""Compute threads pinned one per core (llmserve/runner/cpu_threads.py): the plan from
LLMSERVE_CPU_OMP_THREADS_BIND, the pinning itself read back from /proc, and the stepping
thread of LLM.generate and of the server's engine thread pinned while the caller keeps its
CPUs."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.async_engine import AsyncLLMEngine
from llmserve.engine.llm_engine import LLMEngine
from llmserve.kernels import cpu as cpu_kernels
from llmserve.runner.cpu_threads import (
    ENV,
    auto_pins_here,
    compute_threads_bound,
    parse_cpu_list,
    plan_cpus,
)
from tests.quantization.tiny_llama import save_tiny_llama

ALLOWED = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="pinning needs two CPUs")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ kernels")
TWO = f"{ALLOWED[0]},{ALLOWED[-1]}" if len(ALLOWED) >= 2 else ""


def cores_of(*groups: list[int]) -> dict[tuple[int, int], list[int]]:
    return {(0, i): list(g) for i, g in enumerate(groups)}


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list(" 5 ") == [5]
    for bad in ("", "a", "1-", "0,0", "-1", "3-1"):
        with pytest.raises(ValueError, match="auto, nobind or a list of distinct CPUs"):
            parse_cpu_list(bad)


def test_auto_takes_one_cpu_per_core_when_torch_has_a_thread_per_core():
    smt = cores_of([0, 4], [1, 5], [2, 6], [3, 7])  # four cores, two hardware threads each
    allowed = set(range(8))
    assert plan_cpus("auto", 4, allowed, smt) == [0, 1, 2, 3]
    assert plan_cpus("", 4, allowed, smt) == [0, 1, 2, 3]  # unset means auto
    # fewer threads than cores (ranks or replicas sharing the machine): nothing pinned
    assert plan_cpus("auto", 2, allowed, smt) is None
    assert plan_cpus("auto", 8, allowed, smt) is None  # more threads than cores
    assert plan_cpus("auto", 1, {3}, cores_of([3])) is None  # one thread: nothing to gain
    assert plan_cpus("nobind", 4, allowed, smt) is None


def test_auto_pins_nothing_where_it_does_not_pay_but_a_list_still_pins():
    """On Intel CPUs auto pins nothing (measured slower there); a list pins all the same."""
    smt = cores_of([0, 4], [1, 5])
    assert plan_cpus("auto", 2, {0, 1, 4, 5}, smt, auto_pins=False) is None
    assert plan_cpus("0,1", 2, {0, 1, 4, 5}, smt, auto_pins=False) == [0, 1]
    with open("/proc/cpuinfo") as f:
        intel = "GenuineIntel" in f.read()
    assert auto_pins_here() is not intel


def test_an_explicit_list_is_taken_as_given_and_checked_against_the_mask():
    allowed = {0, 1, 2, 3}
    assert plan_cpus("2,0", 2, allowed, cores_of([0], [1], [2], [3])) == [2, 0]
    assert plan_cpus("1-3", 2, allowed, cores_of([0], [1], [2], [3])) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"CPUs \[5\] are not in this process's affinity mask"):
        plan_cpus("0,5", 2, allowed, cores_of([0], [1]))


def _thread_cpus() -> dict[int, tuple[set[int], int]]:
    """Each thread of this process: (its allowed CPUs, its CPU time in clock ticks)."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        status = open(f"/proc/self/task/{tid}/status").read()
        mask = next(
            ln.split(":")[1] for ln in status.splitlines() if ln.startswith("Cpus_allowed_list")
        )
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        threads[int(tid)] = (set(parse_cpu_list(mask)), int(fields[11]) + int(fields[12]))
    return threads


@pytest.fixture
def restore_threads():
    threads, mask = torch.get_num_threads(), os.sched_getaffinity(0)
    yield
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, mask)


@needs_kernels
@needs_two_cpus
def test_the_block_pins_the_caller_and_the_worker_that_runs_torch_ops(monkeypatch, restore_threads):
    monkeypatch.setenv(ENV, TWO)
    first, second = ALLOWED[0], ALLOWED[-1]
    before = os.sched_getaffinity(0)
    with compute_threads_bound("cpu") as cpus:
        assert cpus == [first, second] and torch.get_num_threads() == 2
        assert os.sched_getaffinity(0) == {first}
        start = _thread_cpus()
        a = torch.randn(768, 768)
        for _ in range(40):
            a = torch.tanh(a @ a)  # a parallel region over both team slots
        end = _thread_cpus()
    # the thread (not the caller) that did most of the work besides the caller is pinned to
    # the second CPU
    caller = threading.get_native_id()
    busiest = max(
        (t for t in end if t != caller and t in start), key=lambda t: end[t][1] - start[t][1]
    )
    assert end[busiest][0] == {second}
    assert end[busiest][1] > start[busiest][1]
    assert os.sched_getaffinity(0) == before  # the caller has its CPUs back
    with compute_threads_bound("cuda") as cpus:
        assert cpus is None and os.sched_getaffinity(0) == before


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-threads"))
    save_tiny_llama(path)
    return path


def _record_stepping_threads(engine: LLMEngine) -> list[tuple[int, set[int]]]:
    """Wrap the runner's execute (the model still runs) to note which thread steps, on which
    CPUs."""
    seen, execute = [], engine.runner.execute

    def recording(sched):
        seen.append((threading.get_native_id(), os.sched_getaffinity(0)))
        return execute(sched)

    engine.runner.execute = recording
    return seen


ENGINE_ARGS = dict(kv_cache_memory=8 << 20, max_model_len=128, device="cpu")
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)


@needs_kernels
@needs_two_cpus
def test_llm_generate_steps_pinned_and_gives_the_caller_its_cpus_back(
    tiny_model, monkeypatch, restore_threads
):
    monkeypatch.setenv(ENV, TWO)
    llm = LLM(model=tiny_model, **ENGINE_ARGS)
    seen = _record_stepping_threads(llm.llm_engine)
    before = os.sched_getaffinity(0)
    pinned = llm.generate(["hello world"] * 3, PARAMS, use_tqdm=False)
    assert seen and all(mask == {ALLOWED[0]} for _, mask in seen)
    assert os.sched_getaffinity(0) == before
    monkeypatch.setenv(ENV, "nobind")
    seen.clear()
    floating = llm.generate(["hello world"] * 3, PARAMS, use_tqdm=False)
    assert seen and all(mask == before for _, mask in seen)
    assert [o.outputs[0].token_ids for o in pinned] == [o.outputs[0].token_ids for o in floating]


@needs_kernels
@needs_two_cpus
def test_the_server_engine_thread_steps_pinned_and_the_event_loop_does_not(
    tiny_model, monkeypatch, restore_threads
):
    monkeypatch.setenv(ENV, TWO)
    engine = AsyncLLMEngine.build(lambda: LLMEngine.from_kwargs(model=tiny_model, **ENGINE_ARGS))
    seen = _record_stepping_threads(engine.engine)
    before = os.sched_getaffinity(0)

    async def main():
        engine.start()
        try:
            async for out in engine.generate("r1", "hello world", PARAMS):
                last = out
            return last
        finally:
            engine.stop()

    out = asyncio.run(main())
    assert len(out.outputs[0].token_ids) == 4
    assert seen and all(mask == {ALLOWED[0]} for _, mask in seen)
    assert all(tid != threading.get_native_id() for tid, _ in seen)
    assert os.sched_getaffinity(0) == before  # the event loop's thread is not pinned


def test_a_bad_bind_list_fails_when_the_engine_starts(tiny_model, monkeypatch):
    monkeypatch.setenv(ENV, "0-1,x")
    with pytest.raises(ValueError, match=f"{ENV}='0-1,x': expected auto, nobind"):
        LLMEngine.from_kwargs(model=tiny_model, **ENGINE_ARGS)

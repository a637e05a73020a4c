"""Data-parallel serving: two replicas on a local Ray instance behind one OpenAI endpoint.

The server is started as a user starts it (``llmserve serve --data-parallel-size 2``) on a
tiny random Llama; the router's choices are checked through /metrics.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from llmserve.distributed.router import PrefixRouter, block_hashes
from tests.quantization.tiny_llama import save_tiny_llama
from tests.server_process import SMALL_SERVER_ARGS, ServerProcess, free_port

pytest.importorskip("ray")

LONG_PROMPT = (
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-dp"))
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def server(tiny_model):
    proc = ServerProcess(tiny_model, "--data-parallel-size", "2", *SMALL_SERVER_ARGS)
    yield proc
    proc.close()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _routed(server: ServerProcess) -> list[float]:
    metrics = server.metrics()
    return [metrics[f'llmserve:replica_requests_routed_total{{replica="{i}"}}'] for i in (0, 1)]


def _complete(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 8):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)


def test_concurrent_requests_use_both_replicas(server, tiny_model):
    client = _client(server)
    before = _routed(server)
    prompts = [f"{i} + {i} = " for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _complete(client, tiny_model, p, 16), prompts))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    after = _routed(server)
    assert after[0] > before[0] and after[1] > before[1]
    assert sum(after) - sum(before) == len(prompts)
    num_prompt = sum(r.usage.prompt_tokens for r in results)  # summed over the replicas
    total = server.wait_for_metric("llmserve:prompt_tokens_total", lambda v: v >= num_prompt)
    assert total >= num_prompt


def test_same_prefix_goes_to_the_same_replica(server, tiny_model):
    client = _client(server)
    before = _routed(server)
    for suffix in ("a", "b", "c"):
        _complete(client, tiny_model, LONG_PROMPT + suffix)
    after = _routed(server)
    assert sorted(a - b for a, b in zip(after, before)) == [0, 3]


def test_closed_stream_aborts_on_the_replica(server, tiny_model):
    client = _client(server)
    stream = client.completions.create(
        model=tiny_model, prompt="abc", max_tokens=900, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    for replica in (0, 1):  # the replica's generate ended, so the router's count went back
        name = f'llmserve:replica_requests_in_flight{{replica="{replica}"}}'
        assert server.wait_for_metric(name, lambda v: v == 0) == 0
    running = server.wait_for_metric("llmserve:num_requests_running", lambda v: v == 0)
    assert running == 0


def test_killed_replica_fails_its_requests_with_503_and_comes_back(server, tiny_model):
    client = _client(server)
    pids = {
        int(m.group(2)): m.group(1)
        for m in re.finditer(r'replica_up\{pid="(\d+)",replica="(\d)"\} 1', _metrics_text(server))
    }
    victim = pids[0]

    def long_request(i: int):
        try:
            params = {"ignore_eos": True}
            return client.completions.create(
                model=tiny_model, prompt=f"{i} {i}", max_tokens=900, extra_body=params
            )
        except openai.APIStatusError as e:
            return e

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(long_request, i) for i in range(6)]
        in_flight = 'llmserve:replica_requests_in_flight{replica="0"}'
        assert server.wait_for_metric(in_flight, lambda v: v >= 1) >= 1
        os.kill(int(victim), signal.SIGKILL)
        results = [f.result(timeout=60) for f in futures]
    failed = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert failed, "a request in flight on the killed replica should fail"
    assert all(e.status_code == 503 and "died" in e.message for e in failed)
    assert any(not isinstance(r, Exception) for r in results)
    for i in range(4):  # the server answers while the replica restarts
        assert _complete(client, tiny_model, f"after {i}").choices[0].text is not None
    restarted = server.wait_for_metric(
        'llmserve:replica_restarts_total{replica="0"}', lambda v: v >= 1
    )
    assert restarted == 1
    up = re.search(r'replica_up\{pid="(\d+)",replica="0"\} 1', _wait_up(server))
    assert up is not None and up.group(1) != victim


def _metrics_text(server: ServerProcess) -> str:
    import httpx

    return httpx.get(server.url + "/metrics", timeout=10).text


def _wait_up(server: ServerProcess, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    text = _metrics_text(server)
    while 'replica="0"} 1' not in text.split("replica_requests_in_flight")[0]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
        text = _metrics_text(server)
    return text


def test_router_prefers_the_longest_cached_prefix_then_the_least_load():
    router = PrefixRouter(2, block_size=4)
    prompt = list(range(10))  # 2 full blocks
    assert len(block_hashes(prompt, 4)) == 2
    first = router.choose(prompt, [0, 1])
    assert first == 0  # equal (empty) prefixes, equal load: the lower index
    assert router.choose(list(range(100, 110)), [0, 1]) == 1  # replica 0 is busier
    assert router.choose(prompt[:8] + [99], [0, 1]) == 0  # its 2 blocks are cached there
    router.done(0)
    router.forget(0)
    assert router.cached_blocks(0, block_hashes(prompt, 4)) == 0
    assert router.choose(prompt, [1]) == 1  # only the healthy candidates


def test_router_keeps_salted_prefixes_apart():
    """A salted prompt counts as cached only on the replica that saw it with that salt."""
    router = PrefixRouter(2, block_size=4)
    prompt = list(range(8))
    assert router.choose(prompt, [0, 1], cache_salt="a") == 0
    router.choose(list(range(50, 58)), [1])  # both replicas equally busy again
    assert router.cached_blocks(0, block_hashes(prompt, 4, "a")) == 2
    assert router.cached_blocks(0, block_hashes(prompt, 4, "b")) == 0
    assert router.cached_blocks(0, block_hashes(prompt, 4)) == 0
    assert router.choose(prompt, [0, 1], cache_salt="a") == 0  # its salted blocks are there


def test_unreachable_ray_address_is_refused_before_any_work(tiny_model):
    port = free_port()  # nothing listens there
    command = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", tiny_model]
    command += ["--data-parallel-size", "2", "--ray-address", f"127.0.0.1:{port}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert f"cannot reach the Ray cluster at '127.0.0.1:{port}'" in done.stderr


def test_data_parallel_flag_errors(tiny_model):
    from llmserve import LLM

    with pytest.raises(ValueError, match="--distributed-executor-backend ray"):
        LLM(tiny_model, data_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="runs engine replicas behind `llmserve serve`"):
        LLM(tiny_model, data_parallel_size=2)
    with pytest.raises(ValueError, match="use it with --data-parallel-size > 1"):
        LLM(tiny_model, distributed_executor_backend="ray")

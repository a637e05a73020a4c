"""The real server (``llmserve serve`` in a subprocess) driven by the ``openai`` client.

Completions and chat, streamed and not, n=2, logprobs, echo, token-id prompts; streamed text
equals the non-streamed text; greedy output equals the offline ``LLM``; 32 concurrent streams
finish correctly and share engine steps (seen in /metrics).
"""

from __future__ import annotations

import asyncio
import re
import sys

import httpx
import openai
import pytest

from tests.server_process import SMALL_SERVER_ARGS, ServerProcess

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
MAX_TOKENS = 8
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(*SMALL_SERVER_ARGS)
    yield server
    server.close()


@pytest.fixture(scope="module")
def greedy_text(client, model) -> str:
    """The server's greedy completion of PROMPT, non-streamed."""
    return complete(client, model).choices[0].text


def complete(client, model, **kwargs):
    args = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **kwargs}
    return client.completions.create(**args)


def chat(client, model, **kwargs):
    args = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    return client.chat.completions.create(**{**args, **kwargs})


# ---- completions ----------------------------------------------------------------------------
def test_completion(client, model):
    response = complete(client, model)
    assert response.id.startswith("cmpl-") and isinstance(response.created, int)
    assert response.object == "text_completion" and response.model == model
    (choice,) = response.choices
    assert choice.text and choice.finish_reason == "length"
    assert response.usage.completion_tokens == MAX_TOKENS
    assert response.usage.prompt_tokens > 0
    total = response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.usage.total_tokens == total


def test_greedy_completion_matches_offline_llm(greedy_text, offline_llm):
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = offline_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    assert greedy_text == expected


def test_streamed_completion_equals_non_streamed(client, model, greedy_text):
    chunks = list(complete(client, model, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy_text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_stop_string_ends_with_stop(client, model):
    text = complete(client, model, max_tokens=16).choices[0].text
    stop = max(text.split(), key=len)
    choice = complete(client, model, max_tokens=16, stop=[stop]).choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == text[: text.find(stop)]


def test_n2_seeded_sampling(client, model):
    response = complete(client, model, n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 2 * MAX_TOKENS
    again = complete(client, model, n=2, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in response.choices]
    streamed = {0: "", 1: ""}
    for chunk in complete(client, model, n=2, temperature=1.0, seed=7, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in response.choices}


def test_completion_logprobs(client, model):
    choice = complete(client, model, logprobs=2).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == MAX_TOKENS
    assert "".join(logprobs.tokens) == choice.text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and logprob <= 0
        assert top[token] == pytest.approx(max(top.values()))  # greedy picks the top token


def test_echo_and_token_id_prompts(client, model, server, greedy_text):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    expected = greedy_text
    by_ids = complete(client, model, prompt=ids, echo=True)
    assert by_ids.choices[0].text == PROMPT + expected
    several = complete(client, model, prompt=[ids, ids])
    assert [c.index for c in several.choices] == [0, 1]
    assert all(c.text == expected for c in several.choices)
    assert several.usage.prompt_tokens == 2 * len(ids)
    streamed = {0: "", 1: ""}
    for chunk in complete(client, model, prompt=[PROMPT, PROMPT], stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {0: expected, 1: expected}


# ---- chat ---------------------------------------------------------------------------------
def test_chat(client, model, offline_llm):
    from llmserve import SamplingParams

    response = chat(client, model)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    message = response.choices[0].message
    assert message.role == "assistant" and message.content
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = offline_llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    assert message.content == expected
    assert response.usage.completion_tokens <= MAX_TOKENS


def test_streamed_chat_equals_non_streamed(client, model):
    expected = chat(client, model, max_completion_tokens=12).choices[0]
    chunks = list(chat(client, model, max_completion_tokens=12, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected.message.content
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_logprobs_and_n2(client, model):
    response = chat(client, model, logprobs=True, top_logprobs=3, n=2)
    assert sorted(c.index for c in response.choices) == [0, 1]
    for choice in response.choices:
        content = choice.logprobs.content
        assert content and all(len(entry.top_logprobs) == 3 for entry in content)
        assert all(entry.top_logprobs[0].token == entry.token for entry in content)  # greedy


# ---- concurrency --------------------------------------------------------------------------
def test_32_concurrent_streams_are_batched(client, model, server):
    prompts = [PROMPT, "Hello, my name is", "1, 2, 3, 4,", "def add(a, b):"]
    expected = {
        p: complete(client, model, prompt=p, max_tokens=16).choices[0].text for p in prompts
    }
    before = server.metrics()

    async def stream_one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, str]:
        text, finish = "", None
        stream = await aclient.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return prompt, text, finish

    async def run_all() -> list[tuple[str, str, str]]:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
        ) as aclient:
            return await asyncio.gather(*(stream_one(aclient, prompts[i % 4]) for i in range(32)))

    results = asyncio.run(run_all())
    assert len(results) == 32
    for prompt, text, finish in results:
        assert text == expected[prompt] and finish is not None
    after = server.metrics()
    steps_over_8 = _steps_over(after, 8) - _steps_over(before, 8)
    assert steps_over_8 > 0, "no engine step ran more than 8 of the 32 sequences together"
    assert server.wait_for_metric("llmserve:num_requests_running", lambda v: v == 0) == 0


def _steps_over(samples: dict[str, float], size: int) -> float:
    total = samples["llmserve:batch_size_count"]
    return total - samples[f'llmserve:batch_size_bucket{{le="{float(size)}"}}']


# ---- other routes -------------------------------------------------------------------------
def test_models_tokenize_detokenize_version(server, model):
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 1024
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=10)
    assert text.json()["prompt"] == PROMPT
    chat_tokens = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=10)
    assert chat_tokens.json()["count"] > tokens["count"]
    assert httpx.get(server.url + "/version", timeout=10).json()["version"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])


def test_metrics_are_exposed(server):
    samples = server.metrics()
    for name in (
        "time_to_first_token_seconds_count",
        "time_per_output_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "batch_size_count",
    ):
        assert "llmserve:" + name in samples, name
    assert samples["llmserve:generation_tokens_total"] > 0
    assert samples['llmserve:request_success_total{finished_reason="length"}'] > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
def test_server_runs_uvloop_and_httptools(server, client, model):
    """uvicorn runs on the C event loop and HTTP parser: the running loop and protocol class
    it logs at start-up, and both libraries mapped into the server process."""
    complete(client, model)  # a request parsed and answered by the running server
    started = re.search(r"event loop (\S+), HTTP protocol (\S+)", server.logs())
    assert started is not None, server.logs()
    assert started.group(1).startswith("uvloop."), started.group(0)
    assert "httptools" in started.group(2), started.group(0)
    with open(f"/proc/{server.proc.pid}/maps") as f:
        mapped = f.read()
    assert "/uvloop/loop." in mapped
    assert "/httptools/parser/parser." in mapped

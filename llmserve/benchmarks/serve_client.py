"""``llmserve bench serve``: a load generator for a running OpenAI-compatible server.

    t = 0 ----x------x--x-----------x----->   Poisson arrivals at --request-rate (inf: all at 0)
              |      |  |           |          at most --max-concurrency in flight
              POST /v1/completions {"stream": true, "ignore_eos": true, "max_tokens": output_len}
              <- data: {"choices": [{"text": ...}]} ... data: [DONE]

Per request: TTFT (send -> first non-empty text chunk), ITL (gaps between chunks), TPOT
((e2e - ttft) / (output tokens - 1)) and end-to-end latency; output tokens from the final
``usage`` chunk when the server sends one, else by tokenizing the streamed text.

The client shares the machine with the server it measures, so it is kept light: aiohttp (C
HTTP parser, as vLLM's ``bench serve``) rather than httpx, whose pure-Python parsing took
~110 us of CPU per streamed chunk (0.9 s in a 38 s run of 64 x 128 tokens on 2 cores); uvloop's
event loop where installed, and the body read as it arrives rather than line by line (one
wake-up an event, not two): 0.24-0.27 -> 0.18-0.21 s of client CPU in a 10 s run of 64 x 128.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import aiohttp
from tqdm.auto import tqdm

from llmserve.benchmarks.metrics import RequestRecord, arrival_times, latency_result
from llmserve.benchmarks.report import format_table
from llmserve.benchmarks.workloads import BenchRequest

COMPLETIONS_PATH = "/v1/completions"


def completion_payload(model: str, request: BenchRequest, temperature: float) -> dict:
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": temperature,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


def fetch_model_name(base_url: str) -> str:
    """The first model the server lists at /v1/models."""

    async def get() -> dict:
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{base_url}/v1/models", raise_for_status=True) as response:
                return await response.json()

    try:
        return asyncio.run(get())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"cannot list models at {base_url}/v1/models ({e}); start the server with "
            "`llmserve serve` or pass --base-url and --served-model-name"
        ) from e


def _loop_factory():
    """uvloop's event loop when installed (a server dependency): its C loop spends less CPU a
    streamed chunk than asyncio's, CPU the server under test would otherwise lose."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _Stream:
    """Parses one SSE completion stream into a RequestRecord."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.text: list[str] = []
        self.usage_tokens: int | None = None
        self.start = time.perf_counter()
        self.last = self.start

    def feed(self, line: str) -> bool:
        """Handle one line; False at ``data: [DONE]``."""
        if not line.startswith("data:"):
            return True
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            self.record.error = str(chunk["error"])[:300]
            return False
        if chunk.get("usage"):
            self.usage_tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                self._token(choice["text"])
        return True

    def _token(self, text: str) -> None:
        now = time.perf_counter()
        if self.record.ttft is None:
            self.record.ttft = now - self.start
        else:
            self.record.itls.append(now - self.last)
        self.last = now
        self.text.append(text)

    def finish(self, tokenizer) -> None:
        if self.record.error is not None or self.record.ttft is None:
            self.record.error = self.record.error or "no tokens received"
            return
        self.record.e2e = time.perf_counter() - self.start
        tokens = self.usage_tokens
        if tokens is None:
            tokens = len(tokenizer.encode("".join(self.text), add_special_tokens=False))
        self.record.output_len = tokens


async def send_request(
    client: aiohttp.ClientSession, url: str, payload: dict, record: RequestRecord, tokenizer
) -> None:
    stream = _Stream(record)
    try:
        async with client.post(url, json=payload) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                record.error = f"HTTP {response.status}: {body[:300]}"
                return
            rest = b""
            async for data in response.content.iter_any():  # one wake-up an event, not a line
                *lines, rest = (rest + data).split(b"\n")
                if not all(stream.feed(line.decode().strip()) for line in lines):
                    break  # [DONE] or an error event
        stream.finish(tokenizer)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"


class _LoadGenerator:
    """Sends each request at its offset, at most ``max_concurrency`` in flight."""

    def __init__(
        self,
        client: aiohttp.ClientSession,
        url: str,
        model: str,
        tokenizer,
        temperature: float,
        max_concurrency: int | None,
    ):
        self.client, self.url, self.model, self.tokenizer = client, url, model, tokenizer
        self.temperature = temperature
        self.limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def _one(self, request: BenchRequest, record: RequestRecord, bar) -> None:
        payload = completion_payload(self.model, request, self.temperature)
        if self.limit is None:
            await send_request(self.client, self.url, payload, record, self.tokenizer)
        else:
            async with self.limit:
                await send_request(self.client, self.url, payload, record, self.tokenizer)
        bar.update(1)

    async def run(
        self, requests: Sequence[BenchRequest], offsets: Sequence[float], use_tqdm: bool
    ) -> tuple[list[RequestRecord], float]:
        records = [RequestRecord(r.prompt_len) for r in requests]
        bar = tqdm(total=len(requests), desc="bench serve", unit="req", disable=not use_tqdm)
        start = time.perf_counter()
        tasks = []
        for request, record, offset in zip(requests, records, offsets):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(self._one(request, record, bar)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        return records, duration


async def run_load(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    tokenizer,
    request_rate: float,
    max_concurrency: int | None,
    temperature: float,
    seed: int,
    use_tqdm: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its Poisson arrival time; return records and the duration."""
    offsets = arrival_times(len(requests), request_rate, seed)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)  # 0: no cap on connections
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
    url = base_url + COMPLETIONS_PATH
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, read_bufsize=2**20
    ) as client:
        await _check_server(client, url, model, requests[0], tokenizer)
        generator = _LoadGenerator(client, url, model, tokenizer, temperature, max_concurrency)
        return await generator.run(requests, offsets, use_tqdm)


async def _check_server(
    client: aiohttp.ClientSession, url: str, model: str, request: BenchRequest, tokenizer
) -> None:
    """One short untimed request: fails fast on a wrong URL or model name, warms the server."""
    record = RequestRecord(request.prompt_len)
    payload = completion_payload(model, BenchRequest(request.prompt, [], 2), 0.0)
    await send_request(client, url, payload, record, tokenizer)
    if record.error is not None:
        raise ValueError(f"the test request to {url} failed: {record.error}")


def run_serve_benchmark(
    base_url: str,
    model: str | None,
    requests: Sequence[BenchRequest],
    tokenizer,
    request_rate: float,
    max_concurrency: int | None,
    temperature: float = 0.0,
    seed: int = 0,
    use_tqdm: bool = True,
) -> dict:
    """The whole client run: latency percentiles and throughput, as a dict."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    base_url = base_url.rstrip("/")
    model = model or fetch_model_name(base_url)
    load = run_load(
        base_url,
        model,
        requests,
        tokenizer,
        request_rate,
        max_concurrency,
        temperature,
        seed,
        use_tqdm,
    )
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        records, duration = runner.run(load)
    result = latency_result(records, duration)
    return {
        "benchmark": "serve",
        "base_url": base_url,
        "model": model,
        "request_rate": request_rate,
        "max_concurrency": max_concurrency,
    } | result


def serve_summary_text(result: dict, markdown: bool = False) -> str:
    rows = [
        ["successful requests", result["completed"]],
        ["failed requests", result["failed"]],
        ["duration (s)", result["duration_s"]],
        ["requests/s", result["request_throughput"]],
        ["output tok/s", result["output_throughput"]],
        ["total tok/s", result["total_token_throughput"]],
    ]
    latency = [
        [label] + [result[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p90", "p99")]
        for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
    ]
    text = format_table(["metric", "value"], rows, markdown) + "\n\n"
    text += format_table(["latency (ms)", "mean", "median", "p90", "p99"], latency, markdown)
    if result["errors"]:
        text += "\nerrors: " + "; ".join(result["errors"])
    return text

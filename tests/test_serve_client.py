"""``llmserve bench serve``'s stream reader against a loopback server that splits its events
across reads at awkward places (mid-line, mid-event, several events in one write)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from llmserve.benchmarks.metrics import RequestRecord
from llmserve.benchmarks.serve_client import send_request


def _event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _choice(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text}]}


async def _read_through(body: str, cuts: list[int]) -> RequestRecord:
    """POST to a server that writes ``body`` in pieces cut at ``cuts``; the client's record."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for start, end in zip([0, *cuts], [*cuts, len(body)]):
            await response.write(body[start:end].encode())
            await asyncio.sleep(0.01)  # a separate read on the client's side
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    record = RequestRecord(prompt_len=3)
    try:
        async with aiohttp.ClientSession() as client:
            url = f"http://127.0.0.1:{port}/v1/completions"
            await send_request(client, url, {"stream": True}, record, tokenizer=None)
    finally:
        await runner.cleanup()
    return record


def test_events_split_across_reads_are_each_counted_once():
    texts = ["Hel", "lo", ",", " wor", "ld"]
    usage = {"choices": [], "usage": {"completion_tokens": len(texts)}}
    body = "".join(_event(_choice(t)) for t in texts) + _event(usage) + _event("[DONE]")
    first = body.index("\n\n")
    # mid-prefix, mid-JSON, between the two newlines, two events at once, mid-[DONE]
    cuts = [2, first - 5, first + 1, body.index("wor"), len(body) - 4]
    record = asyncio.run(_read_through(body, cuts))
    assert record.error is None
    assert record.output_len == len(texts)
    assert record.ttft is not None and record.e2e is not None
    assert len(record.itls) == len(texts) - 1  # one gap between each two text chunks


def test_stream_ends_at_done_and_an_error_event_fails_the_request():
    body = _event(_choice("a")) + _event({"error": {"message": "engine failed"}})
    body += _event(_choice("never read"))
    record = asyncio.run(_read_through(body, [len(body) // 2]))
    assert record.error is not None and "engine failed" in record.error

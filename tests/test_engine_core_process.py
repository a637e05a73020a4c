"""``llmserve serve --engine-core-process``: the engine in a process of its own.

The output deltas round-trip (growing outputs, a stop string's cut, beams that reorder,
logprobs, prompt logprobs); then a real server on the default model: the same greedy text,
logprobs and beams as the offline ``LLM``, concurrent streams batched, a bad request answered
400 while the engine goes on, a cache_salt kept on its way to the core, a client disconnect
aborted (counted in /metrics), SIGTERM ending a stream with "abort" and exit 0, and a killed
core turning /health to 503 with the request in flight ended by an error instead of a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from llmserve.engine.output_deltas import OutputDecoder, OutputEncoder
from llmserve.outputs import CompletionOutput, RequestOutput
from tests.server_process import SMALL_SERVER_ARGS, ServerProcess

PROMPT = "The capital of France is"
TIMEOUT = httpx.Timeout(120.0)
ABORTED = 'llmserve:request_success_total{finished_reason="abort"}'


def snapshot(texts, tokens, finished=False, logprobs=None, prompt_logprobs=None):
    outputs = [
        CompletionOutput(i, t, list(ids), -1.5 * len(ids), lp, "length" if finished else None)
        for i, (t, ids, lp) in enumerate(zip(texts, tokens, logprobs or [None] * len(texts)))
    ]
    return RequestOutput("r", "hi", [1, 2], outputs, finished, prompt_logprobs, 0, {"t": 1.0})


def round_trip(snapshots, grows=True):
    encoder, decoder = OutputEncoder(), OutputDecoder()
    deltas = [encoder.encode(s, grows) for s in snapshots]
    return deltas, [decoder.decode(d) for d in deltas]


def test_growing_outputs_travel_as_their_new_tails():
    lps = [{5: -0.1}, {6: -0.2}, {7: -0.3}]
    snaps = [
        snapshot(["a"], [[5]], logprobs=[lps[:1]], prompt_logprobs=[None, {2: -1.0}]),
        snapshot(["ab"], [[5, 6]], logprobs=[lps[:2]], prompt_logprobs=[None, {2: -1.0}]),
        snapshot(["abc"], [[5, 6, 7]], True, logprobs=[lps], prompt_logprobs=[None, {2: -1.0}]),
    ]
    deltas, decoded = round_trip(snaps)
    assert decoded == snaps
    assert deltas[0].prompt == ("hi", [1, 2], [None, {2: -1.0}])
    assert deltas[1].prompt is None and deltas[2].prompt is None  # the prompt goes once
    last = deltas[2].outputs[0]
    assert (last.text, last.text_from, last.token_ids, last.tokens_from) == ("c", 2, [7], 2)
    assert last.logprobs == [{7: -0.3}] and last.logprobs_from == 2


def test_cut_text_and_reordered_beams_are_sent_whole():
    cut = [snapshot(["hello wo"], [[1, 2]]), snapshot(["hello"], [[1, 2, 3]], True)]
    deltas, decoded = round_trip(cut)
    assert decoded == cut and deltas[1].outputs[0].text_from == 0  # a stop string cut it
    beams = [snapshot(["", ""], [[4, 5], [4, 6]]), snapshot(["", ""], [[4, 6, 1], [9]])]
    deltas, decoded = round_trip(beams, grows=False)
    assert decoded == beams and all(d.tokens_from == 0 for d in deltas[1].outputs)


def test_each_decoded_snapshot_has_lists_of_its_own():
    snaps = [snapshot(["a"], [[5]]), snapshot(["ab"], [[5, 6]])]
    _, decoded = round_trip(snaps)
    assert decoded[0].outputs[0].token_ids == [5]  # not extended by the second step
    assert decoded[0].outputs[0].token_ids is not decoded[1].outputs[0].token_ids


# ---- a real server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--engine-core-process", *SMALL_SERVER_ARGS)
    yield server
    server.close()


@pytest.fixture(scope="module")
def llm():
    from llmserve import LLM

    return LLM(max_model_len=1024, kv_cache_memory=200_000_000)


def complete(server, **body) -> dict:
    body = {"model": model_of(server), "prompt": PROMPT, "max_tokens": 8, "temperature": 0} | body
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    return reply.json()


def model_of(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]


def stream_texts(server, **body) -> tuple[list[str], list[dict]]:
    body = {"model": model_of(server), "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "stream": True} | body  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    return [c["choices"][0]["text"] for c in chunks if c["choices"]], chunks


def test_greedy_text_and_logprobs_match_the_offline_llm(server, llm):
    from llmserve import SamplingParams

    reply = complete(server, logprobs=2, echo=True, max_tokens=10)
    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, logprobs=2))
    choice, expected = reply["choices"][0], offline[0].outputs[0]
    assert choice["text"] == PROMPT + expected.text
    tops = choice["logprobs"]["top_logprobs"]
    assert len(tops) == len(offline[0].prompt_token_ids) + 10  # the prompt's too (echo)
    assert tops[0] is None and all(len(t) >= 2 for t in tops[1:])
    sampled = choice["logprobs"]["token_logprobs"][-10:]
    want = [lp[t] for lp, t in zip(expected.logprobs, expected.token_ids)]
    assert sampled == pytest.approx(want, abs=1e-3)
    texts, _ = stream_texts(server, max_tokens=10)
    assert "".join(texts) == expected.text
    # stream_interval: the core sends a request's output every 4 tokens (and its first and
    # last), the deltas between them rebuilt whole on the server's side
    texts, chunks = stream_texts(server, max_tokens=10, stream_interval=4, return_token_ids=True)
    assert "".join(texts) == expected.text
    assert [len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]][0] == 1
    assert len(texts) <= 4  # after the first: tokens 5, 9 and the last (fewer if behind)


def test_beam_search_matches_the_offline_llm(server, llm):
    from llmserve import BeamSearchParams

    reply = complete(server, max_tokens=6, ignore_eos=True, use_beam_search=True, beam_width=3)
    offline = llm.beam_search([PROMPT], BeamSearchParams(3, 6, ignore_eos=True))[0]
    assert [c["text"] for c in reply["choices"]] == [s.text for s in offline.sequences]


def test_concurrent_streams_share_steps(server):
    before = server.metrics()

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": model_of(server), "prompt": f"{i} + {i} =", "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        reply = await client.post(server.url + "/v1/completions", json=body)
        return reply.json()["choices"][0]["finish_reason"]

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    assert asyncio.run(all_at_once()) == ["length"] * 12
    after = server.metrics()
    generated = (
        after["llmserve:generation_tokens_total"] - before["llmserve:generation_tokens_total"]
    )
    steps = after["llmserve:num_steps_total"] - before["llmserve:num_steps_total"]
    assert generated == 12 * 12
    assert steps < generated / 2  # batched: many sequences per step


def test_a_bad_request_is_400_and_the_engine_goes_on(server):
    body = {"model": model_of(server), "prompt": "hi " * 2000, "max_tokens": 4}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert reply.status_code == 400 and "1024" in reply.json()["error"]["message"]
    assert complete(server)["choices"][0]["finish_reason"] == "length"


def test_cache_salt_travels_to_the_core(server):
    """The salt goes to the core's engine with the prompt: a salted prompt's blocks serve its
    salt only (the client once sent the token ids alone, and every salt shared the blocks)."""
    prompt = " ".join(f"c{i}y{i * 7}" for i in range(20))  # seen by no other test

    def cached(**salt) -> int:
        reply = complete(server, prompt=prompt, max_tokens=1, **salt)
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0


def test_a_client_disconnect_is_aborted_and_counted(server):
    before = server.metrics().get(ABORTED, 0)
    body = {"model": model_of(server), "prompt": PROMPT, "max_tokens": 500, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: {")) >= 2
    assert server.wait_for_metric(ABORTED, lambda v: v == before + 1) == before + 1
    assert server.wait_for_metric("llmserve:num_requests_running", lambda v: v == 0) == 0


def test_sigterm_ends_a_stream_with_abort_and_exits_0(server):
    body = {"model": model_of(server), "prompt": PROMPT, "max_tokens": 500, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert server.stop() == 0


def test_a_dead_core_fails_the_request_in_flight_and_health():
    server = ServerProcess("--engine-core-process", *SMALL_SERVER_ARGS)
    try:
        core = core_pid(server.proc.pid)
        body = {"model": model_of(server), "prompt": PROMPT, "max_tokens": 500, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            os.kill(core, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "engine-core process exited" in error["message"]
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 503
        refused = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert refused.status_code == 503 and "exited" in refused.json()["error"]["message"]
    finally:
        server.close()


def core_pid(server_pid: int) -> int:
    """The engine-core process: the server's child that runs multiprocessing's spawn."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    raise AssertionError(f"no engine-core process among {children}")

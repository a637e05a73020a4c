"""Errors, API key, back-pressure, client disconnects and SIGTERM, on a small real server.

The server runs with ``--api-key``, one sequence per step and at most two waiting requests,
so back-pressure is easy to reach. The SIGTERM test stops it and therefore runs last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server_process import SMALL_SERVER_ARGS, ServerProcess

KEY = "test-key"
MODEL = "smol"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = httpx.Timeout(60.0)
CHAT = [{"role": "user", "content": "hi"}]
LONG = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


# --chat-template's file: turns as ChatML, each role in capitals (the model's own template
# writes it as given), so a templated prompt shows which template made it; a "preface"
# variable (chat_template_kwargs) goes first
TEMPLATE = (
    "{% if preface is defined %}{{ preface }}\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] | upper }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>ASSISTANT\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["--api-key", KEY, "--served-model-name", MODEL, "--max-num-seqs", "1"]
    args += ["--chat-template", str(template)]
    server = ServerProcess(*SMALL_SERVER_ARGS, *args, "--max-num-waiting", "2")
    yield server
    server.close()


def post(server, path: str, body, headers=AUTH, timeout=TIMEOUT) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {"Content-Type": "application/json", **headers}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def wait_idle(server) -> None:
    assert server.wait_for_metric("llmserve:num_requests_running", lambda v: v == 0) == 0
    assert server.wait_for_metric("llmserve:num_requests_waiting", lambda v: v == 0) == 0
    assert server.wait_for_metric("llmserve:kv_cache_usage_perc", lambda v: v == 0) == 0


# ---- 400 ----------------------------------------------------------------------------------
_COMPLETION = "/v1/completions"
_CHAT = "/v1/chat/completions"
BAD_REQUESTS = [
    (_COMPLETION, {"prompt": "hi", "temperature": -1}, "temperature"),
    (_COMPLETION, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (_COMPLETION, {"prompt": "hi", "top_k": -5}, "top_k"),
    (_COMPLETION, {"prompt": "hi", "n": 0}, "n"),
    (_COMPLETION, {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    (_COMPLETION, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (_COMPLETION, {"prompt": "hi", "logprobs": 99}, "logprobs"),
    (_COMPLETION, {"prompt": "hi", "stop": [""]}, "stop"),
    (_COMPLETION, {"prompt": "hi", "stop": 5}, "stop"),
    (_COMPLETION, {"prompt": "hi", "logit_bias": {"-5": 1}}, "logit_bias"),
    (_COMPLETION, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    (_COMPLETION, {"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
    (_COMPLETION, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    (_COMPLETION, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (_COMPLETION, {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    (_COMPLETION, {"prompt": "hi", "stream": "maybe"}, "stream"),
    (_COMPLETION, {"prompt": "hi", "seed": 2**70}, "seed"),
    (_COMPLETION, {"prompt": []}, "prompt"),
    (_COMPLETION, {"prompt": [1, "a"]}, "prompt"),
    (_COMPLETION, {"prompt": [10**9]}, None),
    (_COMPLETION, {"prompt": ""}, "prompt"),
    (_COMPLETION, {"prompt": ["hi", ""]}, "prompt"),
    (_COMPLETION, {"prompt": "hi", "best_of": 2}, "best_of"),
    (_COMPLETION, {"prompt": "hi", "best_of": 0}, "best_of"),
    (_COMPLETION, {"prompt": "hi", "suffix": "after"}, "suffix"),
    (_COMPLETION, {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    (_COMPLETION, {"prompt": "hi", "allowed_token_ids": [10**6]}, "allowed_token_ids"),
    (_COMPLETION, {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (_COMPLETION, {"prompt": "hi", "bad_words": [" "]}, "bad_words"),
    (_CHAT, {"messages": CHAT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    (_COMPLETION, {"prompt": "hi", "use_beam_search": True, "logit_bias": {"5": 1}}, None),
    (_COMPLETION, {"prompt": "hi", "prompt_logprobs": 1}, "prompt_logprobs"),
    (_COMPLETION, {}, "prompt"),
    (_COMPLETION, {"prompt": 5}, "prompt"),
    (_COMPLETION, {"prompt": "\ud800"}, "prompt"),
    (_COMPLETION, {"prompt": "hi", "temperature": float("nan")}, "temperature"),
    (_COMPLETION, {"prompt": "hi", "top_p": float("inf")}, "top_p"),
    (_CHAT, {"messages": []}, "messages"),
    (_CHAT, {"messages": "hi"}, "messages"),
    (_CHAT, {"messages": [{"content": "hi"}]}, "messages"),
    (_CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    (_CHAT, {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    (_CHAT, {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    (_CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_invalid_parameters_are_400(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


def test_chat_template_flag_replaces_the_models_template(server):
    """Chat requests and /tokenize render through --chat-template's file."""
    tokens = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text == "<|im_start|>USER\nhi<|im_end|>\n<|im_start|>ASSISTANT\n"
    reply = post(server, _CHAT, {"messages": CHAT, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(tokens)
    variables = {"messages": CHAT, "chat_template_kwargs": {"preface": "PREFACE"}}
    tokens = post(server, "/tokenize", variables).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text.startswith("PREFACE\n<|im_start|>USER\nhi")
    reply = post(server, _CHAT, {**variables, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(tokens)
    reserved = {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}
    for path in (_CHAT, "/tokenize"):
        assert_error(post(server, path, reserved), 400, "chat_template_kwargs")


def test_chat_template_values_are_checked_at_start_up(tmp_path):
    from llmserve.entrypoints.openai.launcher import read_chat_template, use_chat_template
    from llmserve.tokenizer import get_tokenizer

    assert read_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    tokenizer = get_tokenizer()
    with pytest.raises(ValueError, match="cannot render a conversation"):
        use_chat_template(tokenizer, "{% for m in messages %}{{ m.content }")  # unclosed
    use_chat_template(tokenizer, TEMPLATE)
    assert tokenizer.chat_template == TEMPLATE


def test_messages_say_what_is_allowed(server):
    """The empty prompt, best_of, suffix and prompt_logprobs get their own messages."""
    error = assert_error(post(server, _COMPLETION, {"prompt": ""}), 400, "prompt")
    assert "prompt is empty" in error["message"]
    error = assert_error(post(server, _COMPLETION, {"prompt": "hi", "best_of": 3}), 400)
    assert "best_of > 1 is not supported" in error["message"]
    error = assert_error(post(server, _COMPLETION, {"prompt": "hi", "suffix": "x"}), 400)
    assert "suffix" in error["message"] and "not supported" in error["message"]
    error = assert_error(post(server, _COMPLETION, {"prompt": "hi", "prompt_logprobs": 0}), 400)
    assert "echo: true with logprobs" in error["message"]
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}}
    error = assert_error(
        post(server, _CHAT, {"messages": [{"role": "user", "content": [image]}]}), 400, "messages"
    )
    assert error["message"] == "messages.0.content.0.type: Input should be 'text'"  # not "a string"
    body = {"input": "hi", "previous_response_id": "resp_1"}  # no --enable-responses-store
    error = assert_error(post(server, "/v1/responses", body), 400, "previous_response_id")
    assert "--enable-responses-store" in error["message"]
    stored = httpx.get(server.url + "/v1/responses/resp_1", headers=AUTH, timeout=TIMEOUT)
    assert stored.status_code == 404 and "--enable-responses-store" in stored.text
    reply = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2})
    assert reply.status_code == 200 and reply.json()["store"] is False  # nothing kept
    document = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()
    field = document["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"not": {}} in field["previous_response_id"]["anyOf"]  # takes no value here
    unset = {"best_of": 1, "suffix": "", "prompt_logprobs": None}  # the defaults still pass
    ok = post(server, _COMPLETION, {"prompt": "hi", "max_tokens": 2, **unset})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


@pytest.mark.parametrize("body", ['{"prompt": "hi",', "[1, 2]", "null", "not json", ""])
def test_malformed_json_is_400(server, body):
    assert_error(post(server, _COMPLETION, body), 400)
    assert_error(post(server, _CHAT, body), 400)


def test_prompt_that_cannot_fit_is_400_with_the_numbers(server):
    prompt = "hello " * 1100
    num_prompt = post(server, "/tokenize", {"prompt": prompt}).json()["count"]
    message = assert_error(post(server, _COMPLETION, {"prompt": prompt, "max_tokens": 7}), 400)[
        "message"
    ]
    assert str(num_prompt) in message and "1024" in message and "7" in message
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 5}
    message = assert_error(post(server, _CHAT, body), 400)["message"]
    assert "1024" in message


def test_budgets_beyond_the_context_stop_at_its_end(server):
    """As vLLM: max_tokens past the context ends at the context ("length"); min_tokens past
    max_tokens means no EOS at all."""
    # a prompt of about 900 tokens, so the budget reaches the 1,024-token context after about
    # a hundred generated ones (from "hi", a thousand at batch 1 took a minute on a slow host)
    messages = [{"role": "user", "content": "hello " * 900}]
    body = {"messages": messages, "max_tokens": 5000, "min_tokens": 5000, "temperature": 0}
    reply = post(server, _CHAT, body, timeout=httpx.Timeout(300.0)).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert 900 < reply["usage"]["prompt_tokens"] < 1000
    assert reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] == 1024
    body = {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}
    assert post(server, _COMPLETION, body).json()["usage"]["completion_tokens"] == 5


def test_openai_client_sees_bad_request(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-2)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)


def test_bad_requests_do_not_harm_others(server):
    result = {}

    def stream_good() -> None:
        body = {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True, "stream": True}
        chunks = []
        with httpx.stream(
            "POST", server.url + _COMPLETION, json=body, headers=AUTH, timeout=TIMEOUT
        ) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        result["finish"] = json.loads(chunks[-1][6:])["choices"][0]["finish_reason"]

    thread = threading.Thread(target=stream_good)
    thread.start()
    for path, body, _ in BAD_REQUESTS:
        assert post(server, path, body).status_code == 400
    thread.join(120)
    assert result == {"finish": "length"}
    wait_idle(server)


_ODD_VALUES = [-1, 10**30, "x", [], {}, None, True, 0.5]
_FIELDS = [
    "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
    "logprobs", "echo", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "stream", "stream_options", "ignore_eos", "min_tokens", "priority", "model",
]  # fmt: skip


@pytest.mark.parametrize("field", _FIELDS)
def test_odd_values_never_cause_a_500(server, field):
    for value in _ODD_VALUES:
        if field == "max_tokens" and value in (None, 10**30):
            continue  # valid, and slow: generates up to max_model_len
        body = {"prompt": "hi", "max_tokens": 2, "model": MODEL, field: value}
        response = post(server, _COMPLETION, body)
        assert response.status_code in (200, 400, 404), (field, value, response.text)
        if response.status_code != 200:
            assert_error(response, response.status_code)
    wait_idle(server)


# ---- 404, 401 -----------------------------------------------------------------------------
def test_unknown_model_is_404(server):
    error = assert_error(post(server, _COMPLETION, {"model": "nope", "prompt": "hi"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(post(server, _CHAT, {"model": "nope", "messages": CHAT}), 404, "model")
    assert_error(httpx.get(server.url + "/v1/no-such-route", headers=AUTH, timeout=TIMEOUT), 404)


def test_api_key(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_error(post(server, _COMPLETION, body, headers={}), 401)
    assert_error(post(server, _COMPLETION, body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(server.url + "/v1/models", timeout=TIMEOUT), 401)
    assert post(server, _COMPLETION, body).status_code == 200
    models = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", timeout=60, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_models_retrieve_by_name(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert_error(httpx.get(server.url + "/v1/models/" + MODEL, timeout=TIMEOUT), 401)


def test_browsers_may_call_from_any_origin_by_default(server):
    """CORS (--allowed-origins, default *): a preflight is answered without the key, with the
    headers a page needs to send its key; responses, 401s among them, carry the origin."""
    origin = {"Origin": "http://example.test"}
    preflight = httpx.options(
        server.url + _COMPLETION,
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
        timeout=TIMEOUT,
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    for headers, status in (({**origin, **AUTH}, 200), (origin, 401)):
        response = httpx.get(server.url + "/v1/models", headers=headers, timeout=TIMEOUT)
        assert response.status_code == status
        assert response.headers["access-control-allow-origin"] == "*"


# ---- 503 ----------------------------------------------------------------------------------
def test_back_pressure_is_503_with_retry_after(server):
    async def open_streams() -> list[int]:
        statuses = []
        async with httpx.AsyncClient(timeout=TIMEOUT, headers=AUTH) as client:
            requests = [
                client.build_request(
                    "POST", server.url + _COMPLETION, json={**LONG, "stream": True}
                )
                for _ in range(8)
            ]
            responses = await asyncio.gather(*(client.send(r, stream=True) for r in requests))
            for response in responses:
                statuses.append(response.status_code)
                if response.status_code == 503:
                    assert int(response.headers["Retry-After"]) >= 1
                    assert_error(httpx.Response(503, content=await response.aread()), 503)
                await response.aclose()  # the accepted streams disconnect: aborted
        return statuses

    statuses = asyncio.run(open_streams())
    assert statuses.count(503) >= 1 and statuses.count(200) >= 1, statuses
    wait_idle(server)


# ---- client disconnects -------------------------------------------------------------------
def _settled_metrics(server) -> dict:
    """/metrics once the abort counter has stopped moving: a previous test's disconnected
    streams are counted as the engine gets to them, after the queues already read empty."""
    aborted, last = _ABORTED, None
    for _ in range(50):
        metrics = server.metrics()
        if last is not None and metrics.get(aborted, 0) == last.get(aborted, 0):
            return metrics
        last = metrics
        time.sleep(0.5)
    raise AssertionError(f"{aborted} still moving after 25 s")


_ABORTED = 'llmserve:request_success_total{finished_reason="abort"}'


def test_disconnect_mid_stream_aborts(server):
    wait_idle(server)
    before = _settled_metrics(server)
    body = {**LONG, "model": MODEL, "stream": True}
    with httpx.stream(
        "POST", server.url + _COMPLETION, json=body, headers=AUTH, timeout=TIMEOUT
    ) as r:
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: {")) >= 2
    wait_idle(server)
    server.wait_for_metric(_ABORTED, lambda v: v > before.get(_ABORTED, 0))
    after = _settled_metrics(server)
    generated = (
        after["llmserve:generation_tokens_total"] - before["llmserve:generation_tokens_total"]
    )
    assert generated < LONG["max_tokens"]
    assert after[_ABORTED] == before.get(_ABORTED, 0) + 1


def test_disconnect_while_waiting_for_a_non_streamed_response_aborts(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        post(server, _COMPLETION, LONG, timeout=httpx.Timeout(60.0, read=3.0))
    wait_idle(server)
    after = server.metrics()
    generated = (
        after["llmserve:generation_tokens_total"] - before["llmserve:generation_tokens_total"]
    )
    assert generated < LONG["max_tokens"]


# ---- shutdown (last: it stops the server) -------------------------------------------------
def test_sigterm_ends_streams_cleanly_and_exits_0(server):
    body = {**LONG, "stream": True}
    with httpx.stream(
        "POST", server.url + _COMPLETION, json=body, headers=AUTH, timeout=TIMEOUT
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert server.stop() == 0

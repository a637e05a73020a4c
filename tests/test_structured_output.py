"""Structured output on the default model: every completed output is valid, offline and over HTTP.

Sampling runs at temperature 1.0 so the model wanders; the grammar mask alone keeps outputs
valid. An output cut by max_tokens says so (finish_reason "length") and is not checked.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from llmserve import LLM, SamplingParams, StructuredOutputsParams
from tests.server_process import SMALL_SERVER_ARGS, ServerProcess

PROMPTS = [
    "Describe a person as JSON.",
    "Give me a user record:",
    "Output JSON for Bob, aged 42, who likes tea.",
    "Tell me about cats.",
    "SELECT",
    "Write a haiku.",
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "pets": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"}},
                "required": ["kind"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
SQL_GBNF = (
    'root ::= "SELECT " col " FROM " tbl ";"\ncol ::= "id" | "name" | "*"\ntbl ::= [a-z]{1,8}'
)
SQL_REGEX = r"SELECT (id|name|\*) FROM [a-z]{1,8};"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def run(llm, constraint: dict, max_tokens: int, n: int = 1):
    params = SamplingParams(
        temperature=1.0, seed=7, n=n, max_tokens=max_tokens, structured_outputs=constraint
    )
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    completions = [c for out in outputs for c in out.outputs]
    assert all(c.finish_reason in ("stop", "length") for c in completions)
    done = [c for c in completions if c.finish_reason == "stop"]
    assert len(done) >= len(completions) // 2, [c.text for c in completions]
    return done


def test_json_schema_outputs_validate(llm):
    for c in run(llm, {"json": PERSON}, max_tokens=96):
        jsonschema.validate(json.loads(c.text), PERSON)


def test_json_object(llm):
    for c in run(llm, {"json_object": True}, max_tokens=64):
        assert isinstance(json.loads(c.text), dict)


def test_regex_and_grammar(llm):
    pattern = r"\d{3}-[a-z]{2,4}"
    for c in run(llm, {"regex": pattern}, max_tokens=24):
        assert re.fullmatch(pattern, c.text), c.text
    for c in run(llm, {"grammar": SQL_GBNF}, max_tokens=24):
        assert re.fullmatch(SQL_REGEX, c.text), c.text


def test_choice_with_parallel_samples(llm):
    choices = ["positive", "negative", 'neutral "quoted"']
    done = run(llm, {"choice": choices}, max_tokens=16, n=3)
    assert len(done) == 3 * len(PROMPTS)  # a choice always completes
    assert all(c.text in choices for c in done)


def test_unconstrained_requests_in_the_same_batch_are_untouched(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    mixed_params = [
        greedy,
        SamplingParams(temperature=1.0, max_tokens=12, structured_outputs={"choice": ["a", "b"]}),
    ]
    mixed = llm.generate([PROMPTS[0], PROMPTS[1]], mixed_params, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[1].outputs[0].text in ("a", "b")


BAD = {
    "regex": ({"regex": "a(b"}, "regex is invalid"),
    "schema": ({"json": {"type": "wat"}}, "json is invalid"),
    "schema-text": ({"json": "{not json"}, "not valid JSON"),
    "choice-empty": ({"choice": []}, "non-empty list"),
    "grammar": ({"grammar": "root ::= ("}, "not valid GBNF"),
    "two-kinds": ({"regex": "a", "choice": ["a"]}, "exactly one"),
    "unknown": ({"xml": "<a/>"}, "unknown field"),
}


@pytest.mark.parametrize("constraint, message", BAD.values(), ids=BAD.keys())
def test_bad_constraints_raise_before_queueing(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["hi"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_dataclass():
    params = StructuredOutputsParams(json='{"type": "integer"}')
    assert params.json == {"type": "integer"} and params.kind == "json"
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


# ---- server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    server = ServerProcess(*SMALL_SERVER_ARGS)
    yield server
    server.close()


def test_server_response_format_and_extra_fields(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120)
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=96,
        temperature=1.0,
        n=2,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        },
    )
    for choice in chat.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    completion = client.completions.create(
        model=chat.model,
        prompt="The review was",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["good", "bad"]}},
    )
    assert completion.choices[0].text in ("good", "bad")
    stream = client.chat.completions.create(
        model=chat.model,
        messages=[{"role": "user", "content": "Give me JSON."}],
        max_tokens=64,
        response_format={"type": "json_object"},
        stream=True,
    )
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads("".join(pieces)), dict)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"structured_outputs": {"regex": "a(b"}}, "regex is invalid"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wat"}},
                }
            },
            "json is invalid",
        ),  # fmt: skip
        ({"structured_outputs": {"choice": []}}, "choice"),
    ],
)
def test_server_bad_constraints_are_400(server, body, message):
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | body
    response = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    health = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert health.status_code == 200  # the engine keeps serving


# ---- tool calls -----------------------------------------------------------------------------
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    },  # fmt: skip
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER | {"additionalProperties": False}, "add": ADD | {"additionalProperties": False}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120)
    return client, client.models.list().data[0].id


def test_tool_choice_required_and_named_always_validate(server):
    client, model = _client(server)
    for tool_choice, names in [("required", set(SCHEMAS)), ({"type": "function", "function": {"name": "add"}}, {"add"})]:  # fmt: skip
        reply = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, n=3,
            temperature=1.0, max_tokens=96,
        )  # fmt: skip
        for choice in reply.choices:
            if choice.finish_reason == "length":
                continue
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                assert call.function.name in names
                jsonschema.validate(
                    json.loads(call.function.arguments), SCHEMAS[call.function.name]
                )


def test_tool_calls_stream_and_round_trip(server):
    client, model = _client(server)
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.3,
        max_tokens=96, stream=True,
    )  # fmt: skip
    calls, finish = {}, None
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta_call.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = delta_call.id or entry["id"]
            entry["name"] += delta_call.function.name or ""
            entry["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    first = calls[0]
    jsonschema.validate(json.loads(first["arguments"]), SCHEMAS[first["name"]])
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": first["id"],
                    "type": "function",
                    "function": {"name": first["name"], "arguments": first["arguments"]},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": first["id"], "content": "18 C and sunny"},
    ]
    answer = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=16
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "needs a non-empty tools list"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "must be a JSON schema of an object",
        ),  # fmt: skip
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),  # fmt: skip
    ],
)
def test_bad_tool_requests_are_400(server, body, message):
    request = {"messages": ASK, "max_tokens": 4} | body
    response = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_auto_mode_parses_tool_call_blocks():
    from llmserve.entrypoints.openai.protocol_chat import ChatCompletionRequest
    from llmserve.entrypoints.openai.tool_calls import parse_auto

    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        "<tool_call>{broken</tool_call><tool_call>"
        + '{"name": "unknown", "arguments": {}}</tool_call>'
    )
    request = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    content, calls = parse_auto(text, request)
    assert content == "Let me check."  # every block is taken out of the text
    assert [c.function.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].function.arguments) == {"a": 1, "b": 2}
    single = ChatCompletionRequest(messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert len(parse_auto(text, single)[1]) == 1
    assert parse_auto("no calls here", request) == ("no calls here", [])


def test_constraints_survive_preemption_and_prefix_hits():
    """A tiny KV pool forces recompute preemption mid-output; the matcher lives on the
    sequence, so recomputed sequences keep their grammar state. Greedy outputs must equal the
    same requests run with room to spare (a second run also hits the prefix cache)."""
    from tests.conftest import assert_no_leaks

    per_block = 46080 * 8
    tight = LLM(kv_cache_memory=9 * per_block, block_size=8, max_model_len=72)
    roomy = LLM(max_model_len=72)
    pattern = r"[a-z]+( [a-z]+){8,14}\."
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"regex": pattern})
    prompts = [f"Tell me about item {i}:" for i in range(6)]
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    for _ in range(2):
        got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
        assert got == expected
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert all(re.fullmatch(pattern, t) for t in expected), expected
    assert_no_leaks(tight)

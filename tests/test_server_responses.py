"""POST /v1/responses (OpenAI's Responses API) on the real server, through the ``openai``
client: the same greedy text as chat completions on the same conversation, the typed stream
events in order and adding up to the response, function calls and their outputs sent back,
text.format, logprobs; with --enable-responses-store, previous_response_id continuing a
stored conversation exactly as sending it whole, and GET / DELETE of stored replies; clear
400s for what is not served (background, non-text parts, built-in tools). A server without
the store refuses previous_response_id (tests/test_server_errors.py)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.server_process import SMALL_SERVER_ARGS, ServerProcess

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]
WEATHER = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(*SMALL_SERVER_ARGS, "--enable-responses-store")
    yield server
    server.close()


def respond(client, model, **kwargs):
    return client.responses.create(model=model, temperature=0, **kwargs)


def test_greedy_text_equals_chat_on_the_same_conversation(client, model):
    response = respond(client, model, instructions="Be brief.", input="What is 2 + 2?",
                       max_output_tokens=12)  # fmt: skip
    chat = client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is 2 + 2?"}],
    )  # fmt: skip
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and message.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert response.instructions == "Be brief." and response.max_output_tokens == 12


def test_message_items_and_content_parts_read_as_text(client, model):
    as_text = respond(client, model, input="Name a color.", max_output_tokens=6)
    as_items = respond(
        client,
        model,
        input=[{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Name a "},
                            {"type": "input_text", "text": "color."}]}],
        max_output_tokens=6,
    )  # fmt: skip
    assert as_items.output_text == as_text.output_text != ""


def test_stream_events_in_order_add_up_to_the_response(client, model):
    events = list(respond(client, model, input="Count: 1, 2,", max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        kinds[-1],
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text
    assert final.usage.output_tokens == 8 or final.status == "completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    same = respond(client, model, input="Count: 1, 2,", max_output_tokens=8)
    assert same.output_text == text


def test_named_function_call_and_its_output_sent_back(client, model):
    choice = {"type": "function", "name": "get_weather"}
    asked = respond(client, model, input=WEATHER, tools=TOOLS, tool_choice=choice,
                    max_output_tokens=60)  # fmt: skip
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21"}
    whole = respond(
        client,
        model,
        input=[{"role": "user", "content": WEATHER},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               output],
        tools=TOOLS,
        max_output_tokens=12,
    )  # fmt: skip
    assert whole.output[0].type == "message" and whole.output_text
    # the same turn on the stored conversation (--enable-responses-store)
    chained = respond(client, model, previous_response_id=asked.id, input=[output], tools=TOOLS,
                      max_output_tokens=12)  # fmt: skip
    assert chained.output_text == whole.output_text


def test_streamed_function_call(client, model):
    choice = {"type": "function", "name": "get_weather"}
    events = list(respond(client, model, input=WEATHER, tools=TOOLS, tool_choice=choice,
                          max_output_tokens=60, stream=True))  # fmt: skip
    final = events[-1].response
    assert events[-1].type == "response.completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]
    assert [e.item_id for e in done] == [c.id for c in calls]


def test_text_format_json_schema(client, model):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = respond(client, model, input="Describe a person as JSON.", max_output_tokens=60,
                       text={"format": {"type": "json_schema", "name": "person",
                                        "schema": schema}})  # fmt: skip
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    echoed = {k: v for k, v in response.to_dict()["text"]["format"].items() if v is not None}
    assert echoed == {"type": "json_schema", "name": "person", "schema": schema}


def test_logprobs_when_included(client, model):
    response = respond(client, model, input="Hi", max_output_tokens=4, top_logprobs=2,
                       include=["message.output_text.logprobs"])  # fmt: skip
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens == 4
    assert all(len(p.top_logprobs) == 2 and p.logprob <= 0 for p in logprobs)
    assert "".join(p.token for p in logprobs) == response.output_text
    plain = respond(client, model, input="Hi", max_output_tokens=4,
                    include=["reasoning.encrypted_content"])  # fmt: skip
    assert plain.output[0].content[0].logprobs is None  # and no reasoning item to include
    assert [item.type for item in plain.output] == ["message"]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "no stored response"),
        ({"background": True}, "background", "not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input", "'input_text' or 'output_text'"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "function_call_output"),
        ({"input": []}, "input", "at least 1 item"),
        ({"tools": [{"type": "web_search"}]}, "tools", "'function'"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs schema"),
        ({"truncation": "auto"}, "truncation", "'disabled'"),
        ({"include": ["output_text.annotations"]}, "include", "message.output_text.logprobs"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_clear_4xx(server, model, body, param, words):
    body = {"model": model, "input": "hi", "max_output_tokens": 2, **body}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == (404 if "previous_response_id" in body else 400), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_previous_response_id_continues_as_the_whole_conversation(client, model):
    first = respond(
        client,
        model,
        instructions="Answer in French.",
        input="My name is Ada.",
        max_output_tokens=8,
    )  # fmt: skip  (instructions are not carried over)
    second = respond(client, model, previous_response_id=first.id, input="What is my name?",
                     max_output_tokens=8)  # fmt: skip
    whole = respond(
        client,
        model,
        input=[{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}],
        max_output_tokens=8,
    )  # fmt: skip
    assert second.output_text == whole.output_text
    assert second.previous_response_id == first.id and second.store
    assert second.usage.input_tokens == whole.usage.input_tokens


def test_stored_responses_are_retrieved_and_deleted(client, model, server):
    kept = respond(client, model, input="Hello", max_output_tokens=4)
    assert client.responses.retrieve(kept.id).to_dict() == kept.to_dict()
    events = list(respond(client, model, input="Hello", max_output_tokens=4, stream=True))
    streamed = events[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    assert streamed.output_text == kept.output_text
    unkept = respond(client, model, input="Hello", max_output_tokens=4, store=False)
    assert not unkept.store
    document = httpx.get(server.url + "/openapi.json", timeout=30).json()
    field = document["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"type": "string"} in field["previous_response_id"]["anyOf"]  # a stored reply's id
    deleted = httpx.delete(f"{server.url}/v1/responses/{kept.id}", timeout=30)
    assert deleted.json() == {"id": kept.id, "object": "response.deleted", "deleted": True}
    for gone in (kept.id, unkept.id):
        missing = httpx.get(f"{server.url}/v1/responses/{gone}", timeout=30)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "response_not_found"


def test_the_store_keeps_the_newest_replies():
    """--enable-responses-store keeps STORE_CAPACITY replies: the oldest go first."""
    from llmserve.entrypoints.openai.protocol_responses import ResponseObject
    from llmserve.entrypoints.openai.serving_responses import STORE_CAPACITY, ResponseStore

    assert STORE_CAPACITY == 1024  # the number docs/serving.md and the flag's help give
    store = ResponseStore(capacity=2)
    replies = [ResponseObject(id=f"resp_{i}", status="completed", model="m", output=[])
               for i in range(3)]  # fmt: skip
    for i, reply in enumerate(replies):
        store.put(reply, [i])
    assert store.get("resp_0") is None
    assert store.get("resp_2") == (replies[2], [2]) and store.get("resp_1")[1] == [1]
    assert store.delete("resp_1") and not store.delete("resp_1")

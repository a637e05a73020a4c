"""Request and response bodies of OpenAI's Responses API (``/v1/responses``), as vLLM serves
it: ``input`` (text, or messages, function calls and their outputs) and ``instructions`` go
through the chat template; the reply is a list of output items (a message of output_text,
function calls). Replies are kept for ``previous_response_id`` only where the server was
started with --enable-responses-store (vLLM keeps none by default either); ``background`` is
refused. Text only: image, file and audio parts are refused."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Discriminator, Field, Tag

from llmserve.entrypoints.openai.protocol import (
    MAX_LOGPROBS,
    Int,
    MaxTokens,
    NonEmptyText,
    OpenAIModel,
    Text,
)
from llmserve.entrypoints.openai.protocol_fields import CacheSalt


# ---- input -----------------------------------------------------------------------------------
class InputText(OpenAIModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier reply sent back
    text: Text


class InputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputText]


class FunctionCallInput(OpenAIModel):
    """A function call the model made earlier (an output item sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(OpenAIModel):
    """What the caller's function returned for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: Text


def _item_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else "message"
    return f"item[{kind}]"


# an item is told by its "type" (a message's may be left out); the tags are bracketed, as
# pydantic's own union tags, so error locations leave them out (errors.py)
InputItem = Annotated[
    Annotated[InputMessage, Tag("item[message]")]
    | Annotated[FunctionCallInput, Tag("item[function_call]")]
    | Annotated[FunctionCallOutput, Tag("item[function_call_output]")],
    Discriminator(
        _item_kind,
        custom_error_type="input_item",
        custom_error_message="an input item's type must be message (the default), "
        "function_call or function_call_output",
    ),
]


# ---- tools and formats -------------------------------------------------------------------------
class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    """``text.format``: plain text, any JSON object, or JSON under ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


def _refuse_background(value: bool) -> bool:
    if value:
        raise ValueError("background is not supported: leave it out or false, or stream instead")
    return value


# previous_response_id: a stored response's id. Only a server started with
# --enable-responses-store takes one; the OpenAPI document of any other says so (openapi_document.py)
PreviousResponseId = Annotated[str, Field(json_schema_extra={"x-stored-responses": True})]
NoBackground = Annotated[
    bool, Field(json_schema_extra={"const": False}), AfterValidator(_refuse_background)
]
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's values of include: the logprobs are given on request; the others name outputs this
# server never makes (reasoning items, built-in tools' results, images), so asking for them
# adds nothing, as asking OpenAI for them on a response without such items
Include = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
]

_FORMAT_NEEDS_SCHEMA = {  # text.format json_schema needs its name and schema
    "if": {
        "properties": {
            "text": {
                "type": "object",
                "required": ["format"],
                "properties": {
                    "format": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": {"const": "json_schema"}},
                    }
                },
            }
        },
        "required": ["text"],
    },
    "then": {
        "properties": {
            "text": {
                "properties": {
                    "format": {
                        "required": ["schema"],
                        "properties": {"schema": {"type": "object"}},
                    }
                }
            }
        }
    },
}
_CHOICE_NEEDS_TOOLS = {  # a tool_choice other than "none" needs tools
    "if": {
        "properties": {"tool_choice": {"not": {"anyOf": [{"type": "null"}, {"const": "none"}]}}},
        "required": ["tool_choice"],
    },
    "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
}


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses: ``input`` (and ``instructions``) through the chat template."""

    model_config = ConfigDict(
        json_schema_extra={"allOf": [_CHOICE_NEEDS_TOOLS, _FORMAT_NEEDS_SCHEMA]}
    )

    model: str | None = None
    input: NonEmptyText | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None  # a system message before the input
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    include: list[Include] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True  # kept for previous_response_id (where the server stores replies)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None  # accepted; this model does not reason apart
    previous_response_id: PreviousResponseId | None = None  # its conversation goes first
    background: NoBackground = False
    # vLLM's extras, as in chat completions
    seed: Int(ge=-(2**63), lt=2**63) | None = None
    priority: Int() = 0
    cache_salt: CacheSalt | None = None


# ---- output ------------------------------------------------------------------------------------
class TopLogprob(OpenAIModel):
    token: str
    bytes: list[int]
    logprob: float


class Logprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[Logprob] | None = None


class OutputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # read from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's field; the prefix cache is not billed here


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"]


class ResponseError(OpenAIModel):
    code: str
    message: str


class ResponseObject(OpenAIModel):
    """A response: its output items, status and usage, with the request's settings."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputItem]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tool_choice: str | FunctionChoice | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    text: TextConfig | None = None
    truncation: str = "disabled"
    previous_response_id: str | None = None
    store: bool = False  # whether this server keeps it (--enable-responses-store)
    user: str | None = None
    usage: ResponseUsage | None = None


class ResponseDeleted(OpenAIModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True

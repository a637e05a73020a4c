"""Request and response bodies of OpenAI's chat completions API (``/v1/chat/completions``):
tools, the request, the response and its stream chunks. The shared pieces (messages, which
/tokenize takes too, sampling fields, usage, the model base class) are in protocol.py."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_serializer

from llmserve.entrypoints.openai.protocol import (
    CONTINUATION_RULE,
    MAX_LOGPROBS,
    ChatMessage,
    Int,
    MaxTokens,
    OpenAIModel,
    SamplingFields,
    TemplateKwargs,
    ToolCall,
    UsageInfo,
)


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: ``messages`` go through the model's chat template."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                CONTINUATION_RULE,
                {  # top_logprobs needs logprobs: true
                    "if": {
                        "properties": {"top_logprobs": {"type": "integer"}},
                        "required": ["top_logprobs"],
                    },
                    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
                },
                {  # a tool_choice other than "none" needs tools
                    "if": {
                        "properties": {
                            "tool_choice": {"not": {"anyOf": [{"type": "null"}, {"const": "none"}]}}
                        },
                        "required": ["tool_choice"],
                    },
                    "then": {
                        "properties": {"tools": {"type": "array", "minItems": 1}},
                        "required": ["tools"],
                    },
                },
            ]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's extra: the reply continues the last message
    echo: bool = False  # vLLM's extra: the reply begins with the last message, if of its role
    chat_template_kwargs: TemplateKwargs | None = None  # vLLM's extra: the template's variables
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the chunk's new tokens


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk

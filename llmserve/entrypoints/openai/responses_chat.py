"""The Responses API in the chat layer's terms (serving_responses.py): a request and its
conversation as a chat completion request; the chat reply's content, tool calls, logprobs and
usage as the Responses API's output items and response object."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError

from llmserve.entrypoints.openai.errors import OpenAIError, validation_error
from llmserve.entrypoints.openai.protocol import ToolCall, UsageInfo
from llmserve.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatLogProbs
from llmserve.entrypoints.openai.protocol_responses import (
    LOGPROBS_INCLUDE,
    FunctionCallInput,
    FunctionCallItem,
    FunctionCallOutput,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    Logprob,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)

# the chat request's fields named as the Responses API names them, in errors
_FIELD_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "logprobs": "include",
}


def to_chat_request(request: ResponsesRequest, items: list[Any]) -> ChatCompletionRequest:
    """The chat completion request that answers ``items`` (the conversation: a previous
    response's, then this request's input) under this request's instructions and settings."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:  # a previous response's are not carried over
        messages.append({"role": "system", "content": request.instructions})
    for item in items:
        if isinstance(item, InputMessage):
            content = item.content
            if isinstance(content, list):
                content = [{"type": "text", "text": part.text} for part in content]
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "priority": request.priority,
        "cache_salt": request.cache_salt,
        "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
        "parallel_tool_calls": request.parallel_tool_calls,
        "user": request.user,
    }
    if wants_logprobs(request):
        body |= {"logprobs": True, "top_logprobs": request.top_logprobs or 0}
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, str):
        body["tool_choice"] = choice
    elif choice is not None:  # a named function
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise OpenAIError('text.format of type "json_schema" needs schema', param="text")
        schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # what the Responses model lets through and chat does not
        raise renamed(validation_error(list(e.errors()))) from e


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # resp_..., msg_..., fc_...: OpenAI's form of ids


def wants_logprobs(request: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (request.include or [])


def renamed(e: OpenAIError) -> OpenAIError:
    """A chat-layer error with the fields named as this request names them."""
    param = _FIELD_NAMES.get(e.param or "", e.param)
    message = e.message
    for chat_name, name in _FIELD_NAMES.items():
        if message.startswith(chat_name + " ") or message.startswith(chat_name + ":"):
            message = name + message[len(chat_name) :]
    return OpenAIError(message, e.status, param, e.code, e.headers)


def output_logprobs(
    logprobs: ChatLogProbs | None, request: ResponsesRequest
) -> list[Logprob] | None:
    """The chat layer's token logprobs (token, logprob, bytes, top alternatives: the same
    fields) as output_text's, where the request includes them."""
    if logprobs is None or not wants_logprobs(request):
        return None
    return [Logprob.model_validate(token.model_dump()) for token in logprobs.content or []]


def output_message(
    message_id: str, text: OutputText | None, incomplete: bool, status: str | None = None
) -> OutputMessage:
    return OutputMessage(
        id=message_id,
        status=status or ("incomplete" if incomplete else "completed"),
        content=[text] if text is not None else [],
    )


def as_call(delta: Any) -> ToolCall:
    return ToolCall(
        id=delta.id, function={"name": delta.function.name, "arguments": delta.function.arguments}
    )


def as_input(item: OutputMessage | FunctionCallItem) -> InputMessage | FunctionCallInput:
    """An output item as the input item that sends it back."""
    if isinstance(item, FunctionCallItem):
        return FunctionCallInput(
            type="function_call", call_id=item.call_id, name=item.name, arguments=item.arguments
        )
    return InputMessage(role="assistant", content="".join(part.text for part in item.content))


def function_call(call: ToolCall) -> FunctionCallItem:
    return FunctionCallItem(
        id=item_id("fc"),
        call_id=call.id,
        name=call.function.name,
        arguments=call.function.arguments,
        status="completed",
    )


def response_object(
    request: ResponsesRequest,
    model: str,
    response_id: str,
    items: list[Any],
    usage: UsageInfo | None,
    incomplete: bool,
    stored: bool,
    status: str | None = None,
) -> ResponseObject:
    return ResponseObject(
        id=response_id,
        status=status or ("incomplete" if incomplete else "completed"),
        model=model,
        output=items,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        metadata=request.metadata,
        parallel_tool_calls=request.parallel_tool_calls,
        temperature=request.temperature,
        top_p=request.top_p,
        top_logprobs=request.top_logprobs,
        tool_choice=request.tool_choice or "auto",
        tools=request.tools or [],
        text=request.text,
        previous_response_id=request.previous_response_id,
        store=stored and request.store,
        user=request.user,
        usage=response_usage(usage) if usage is not None else None,
    )


def response_usage(usage: UsageInfo) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )

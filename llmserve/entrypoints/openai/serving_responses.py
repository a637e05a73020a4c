"""POST /v1/responses: OpenAI's Responses API on the chat completions machinery.

A request becomes a chat completion request (``instructions`` a system message, ``input``
items messages, function calls an assistant turn's tool calls, their outputs tool turns;
``text.format`` the response_format, ``max_output_tokens`` the budget), so templating, tools,
structured output and sampling are the chat endpoint's own. The reply comes back as output
items: a message of output_text, then one item per function call; streamed, as the Responses
API's typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``), each an SSE ``event:`` line with its ``data:``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from itertools import count
from typing import Any

from pydantic import ValidationError

from llmserve.engine.request_stream import RequestStream
from llmserve.entrypoints.openai.errors import OpenAIError, error_from_exception
from llmserve.entrypoints.openai.protocol import ToolCall, UsageInfo, dump
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
    TopLogprob,
)
from llmserve.entrypoints.openai.serving_base import EventStream
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat

# the chat request's fields named as the Responses API names them, in errors
_FIELD_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "logprobs": "include",
}


class OpenAIServingResponses:
    """Builds responses and their stream events from the chat layer's replies."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def abort(self, streams: list[RequestStream]) -> None:
        self.chat.abort(streams)

    async def create(self, request: ResponsesRequest) -> ResponseObject | EventStream:
        """Queue the conversation; a response, or (``stream``) an SSE event stream."""
        chat_request = to_chat_request(request)
        try:
            request_id, stream, how = await self.chat.queue(chat_request, id_prefix="resp")
        except OpenAIError as e:
            raise _renamed(e) from e
        response_id = request_id.replace("-", "_", 1)  # resp_<hex>, as OpenAI's ids read
        if request.stream:
            events = self._stream(request, chat_request, response_id, request_id, stream, how)
            return EventStream(events, [stream])
        (out,) = await self.chat.final_outputs([stream])
        reply = self.chat.response(chat_request, request_id, how, out)
        choice = reply.choices[0]
        items: list[Any] = []
        incomplete = choice.finish_reason == "length"
        if choice.message.content is not None or not choice.message.tool_calls:
            text = _output_text(choice.message.content or "", choice.logprobs, request)
            items.append(_message(_item_id("msg"), text, incomplete))
        items += [_function_call(call) for call in choice.message.tool_calls or []]
        return _response(request, self.chat.model_name, response_id, items, reply.usage,
                         incomplete)  # fmt: skip

    async def _stream(
        self,
        request: ResponsesRequest,
        chat_request: ChatCompletionRequest,
        response_id: str,
        request_id: str,
        stream: RequestStream,
        how: str,
    ) -> AsyncIterator[str]:
        sequence = count()

        def event(kind: str, **fields: Any) -> str:
            body = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        def open_message() -> list[str]:  # the message item and its text part, both empty
            empty = _message(message_id, None, False, "in_progress")
            return [
                event("response.output_item.added", output_index=0, item=dump(empty)),
                event("response.content_part.added", **where, part=dump(OutputText(text=""))),
            ]

        model = self.chat.model_name
        started = _response(request, model, response_id, [], None, False, status="in_progress")
        yield event("response.created", response=dump(started))
        yield event("response.in_progress", response=dump(started))
        message_id, text, logprobs = _item_id("msg"), "", []
        calls: list[ToolCall] = []
        opened, finish_reason, usage = False, None, None
        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        try:
            chunks = self.chat.chunks(chat_request, request_id, stream, how)
            async with aclosing(chunks) as chunks:
                async for chunk in chunks:
                    if chunk.usage is not None and not chunk.choices:
                        usage = chunk.usage
                        continue
                    choice = chunk.choices[0]
                    finish_reason = choice.finish_reason or finish_reason
                    for call in choice.delta.tool_calls or []:
                        calls.append(_as_call(call))
                    if not choice.delta.content:
                        continue
                    if not opened:
                        opened = True
                        for opening in open_message():
                            yield opening
                    new = _logprobs(choice.logprobs, request) or []
                    text += choice.delta.content
                    logprobs += new
                    yield event("response.output_text.delta", **where,
                                delta=choice.delta.content, logprobs=[dump(p) for p in new])  # fmt: skip
        except Exception as e:  # the engine failed mid-stream: say so, then end the stream
            error = error_from_exception(e)
            yield event("error", code=str(error.code or error.status), message=error.message,
                        param=None)  # fmt: skip
            return
        finally:
            self.abort([stream])
        incomplete = finish_reason == "length"
        items: list[Any] = []
        if opened or not calls:  # a reply always has its message, if only an empty one
            part = OutputText(text=text, logprobs=logprobs if _wants_logprobs(request) else None)
            message = _message(message_id, part, incomplete)
            for opening in [] if opened else open_message():
                yield opening
            yield event("response.output_text.done", **where, text=text,
                        logprobs=[dump(p) for p in part.logprobs or []])  # fmt: skip
            yield event("response.content_part.done", **where, part=dump(part))
            yield event("response.output_item.done", output_index=0, item=dump(message))
            items.append(message)
        for call in calls:
            item = _function_call(call)
            at = {"item_id": item.id, "output_index": len(items)}
            opening = item.model_copy(update={"arguments": "", "status": "in_progress"})
            yield event("response.output_item.added", output_index=len(items), item=dump(opening))
            yield event("response.function_call_arguments.delta", **at, delta=item.arguments)
            yield event("response.function_call_arguments.done", **at, arguments=item.arguments)
            yield event("response.output_item.done", output_index=len(items), item=dump(item))
            items.append(item)
        final = _response(request, model, response_id, items, usage, incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        yield event(kind, response=dump(final))


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that computes this response."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    items = request.input
    if isinstance(items, str):
        items = [InputMessage(role="user", content=items)]
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
    if _wants_logprobs(request):
        body |= {"logprobs": True, "top_logprobs": request.top_logprobs or 0}
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )  # fmt: skip
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
        raise OpenAIError(f"input: {e.errors()[0]['msg']}", param="input") from e


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # msg_..., fc_...: OpenAI's form of item ids


def _wants_logprobs(request: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (request.include or [])


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat-layer error with the fields named as this request names them."""
    param = _FIELD_NAMES.get(e.param or "", e.param)
    message = e.message
    for chat_name, name in _FIELD_NAMES.items():
        if message.startswith(chat_name + " ") or message.startswith(chat_name + ":"):
            message = name + message[len(chat_name) :]
    return OpenAIError(message, e.status, param, e.code, e.headers)


def _logprobs(logprobs: ChatLogProbs | None, request: ResponsesRequest) -> list[Logprob] | None:
    if logprobs is None or not _wants_logprobs(request):
        return None
    return [
        Logprob(
            token=t.token,
            bytes=t.bytes if t.bytes is not None else list(t.token.encode()),
            logprob=t.logprob,
            top_logprobs=[
                TopLogprob(
                    token=top.token,
                    bytes=top.bytes if top.bytes is not None else list(top.token.encode()),
                    logprob=top.logprob,
                )
                for top in t.top_logprobs
            ],
        )
        for t in logprobs.content or []
    ]


def _output_text(text: str, logprobs: ChatLogProbs | None, request: ResponsesRequest) -> OutputText:
    return OutputText(text=text, logprobs=_logprobs(logprobs, request))


def _message(
    message_id: str, text: OutputText | None, incomplete: bool, status: str | None = None
) -> OutputMessage:
    return OutputMessage(
        id=message_id,
        status=status or ("incomplete" if incomplete else "completed"),
        content=[text] if text is not None else [],
    )


def _as_call(delta: Any) -> ToolCall:
    return ToolCall(
        id=delta.id, function={"name": delta.function.name, "arguments": delta.function.arguments}
    )


def _function_call(call: ToolCall) -> FunctionCallItem:
    return FunctionCallItem(
        id=_item_id("fc"),
        call_id=call.id,
        name=call.function.name,
        arguments=call.function.arguments,
        status="completed",
    )


def _response(
    request: ResponsesRequest,
    model: str,
    response_id: str,
    items: list[Any],
    usage: UsageInfo | None,
    incomplete: bool,
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
        user=request.user,
        usage=_usage(usage) if usage is not None else None,
    )


def _usage(usage: UsageInfo) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )

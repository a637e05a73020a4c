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
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from itertools import count
from typing import Any

from llmserve.engine.request_stream import RequestStream
from llmserve.entrypoints.openai import responses_chat
from llmserve.entrypoints.openai.errors import OpenAIError, error_from_exception
from llmserve.entrypoints.openai.protocol import ToolCall, dump
from llmserve.entrypoints.openai.protocol_chat import ChatCompletionRequest
from llmserve.entrypoints.openai.protocol_responses import (
    InputMessage,
    OutputText,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from llmserve.entrypoints.openai.serving_base import EventStream
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat

STORE_CAPACITY = 1024  # replies --enable-responses-store keeps, the newest


class ResponseStore:
    """The newest replies of /v1/responses, each with the conversation that led to it and its
    output (as input items: what a request naming it as previous_response_id continues), in
    memory: gone with the server, as vLLM's store."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[ResponseObject, list[Any]]] = OrderedDict()

    def put(self, response: ResponseObject, conversation: list[Any]) -> None:
        self._entries[response.id] = (response, conversation)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[ResponseObject, list[Any]] | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


class OpenAIServingResponses:
    """Builds responses and their stream events from the chat layer's replies."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.store = ResponseStore() if chat.options.store_responses else None

    def retrieve(self, response_id: str) -> ResponseObject:
        """GET /v1/responses/{id}: a stored reply, or a 404."""
        return self._stored(response_id, "response_id")[0]

    def delete(self, response_id: str) -> ResponseDeleted:
        """DELETE /v1/responses/{id}: forget a stored reply (404 when there is none)."""
        self._stored(response_id, "response_id")  # a 404 unless kept
        self.store.delete(response_id)
        return ResponseDeleted(id=response_id)

    def _stored(self, response_id: str, param: str) -> tuple[ResponseObject, list[Any]]:
        if self.store is None:
            raise OpenAIError(
                f"{param}: this server stores no responses (start it with "
                "--enable-responses-store); send the earlier turns in input instead",
                404 if param == "response_id" else 400,
                param=param,
            )
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(
                f"no stored response {response_id!r} (the server keeps its newest "
                f"{self.store.capacity})",
                404,
                param=param,
                code="response_not_found",
            )
        return entry

    def _conversation(self, request: ResponsesRequest) -> list[Any]:
        """The items the reply answers: a previous response's conversation, then the input."""
        items = request.input
        if isinstance(items, str):
            items = [InputMessage(role="user", content=items)]
        if request.previous_response_id is None:
            return list(items)
        return self._stored(request.previous_response_id, "previous_response_id")[1] + items

    def _keep(self, request: ResponsesRequest, response: ResponseObject, items: list[Any]) -> None:
        if self.store is not None and request.store:
            self.store.put(
                response, items + [responses_chat.as_input(item) for item in response.output]
            )

    def abort(self, streams: list[RequestStream]) -> None:
        self.chat.abort(streams)

    async def create(self, request: ResponsesRequest) -> ResponseObject | EventStream:
        """Queue the conversation; a response, or (``stream``) an SSE event stream."""
        conversation = self._conversation(request)
        chat_request = responses_chat.to_chat_request(request, conversation)
        try:
            response_id, stream, how = await self.chat.queue(
                chat_request, responses_chat.item_id("resp")
            )
        except OpenAIError as e:
            raise responses_chat.renamed(e) from e
        if request.stream:
            events = self._stream(request, chat_request, conversation, response_id, stream, how)
            return EventStream(events, [stream])
        (out,) = await self.chat.final_outputs([stream])
        reply = self.chat.response(chat_request, response_id, how, out)
        choice = reply.choices[0]
        items: list[Any] = []
        incomplete = choice.finish_reason == "length"
        if choice.message.content is not None or not choice.message.tool_calls:
            logprobs = responses_chat.output_logprobs(choice.logprobs, request)
            text = OutputText(text=choice.message.content or "", logprobs=logprobs)
            items.append(
                responses_chat.output_message(responses_chat.item_id("msg"), text, incomplete)
            )
        items += [responses_chat.function_call(call) for call in choice.message.tool_calls or []]
        stored = self.store is not None
        response = responses_chat.response_object(
            request,
            self.chat.reply_model(request.model),
            response_id,
            items,
            reply.usage,
            incomplete,
            stored,
        )
        self._keep(request, response, conversation)
        return response

    async def _stream(
        self,
        request: ResponsesRequest,
        chat_request: ChatCompletionRequest,
        conversation: list[Any],
        response_id: str,
        stream: RequestStream,
        how: str,
    ) -> AsyncIterator[str]:
        sequence = count()

        def event(kind: str, **fields: Any) -> str:
            body = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        def open_message() -> list[str]:  # the message item and its text part, both empty
            empty = responses_chat.output_message(message_id, None, False, "in_progress")
            return [
                event("response.output_item.added", output_index=0, item=dump(empty)),
                event("response.content_part.added", **where, part=dump(OutputText(text=""))),
            ]

        model = self.chat.reply_model(request.model)
        stored = self.store is not None
        started = responses_chat.response_object(
            request, model, response_id, [], None, False, stored, "in_progress"
        )
        yield event("response.created", response=dump(started))
        yield event("response.in_progress", response=dump(started))
        message_id, text, logprobs = responses_chat.item_id("msg"), "", []
        calls: list[ToolCall] = []
        opened, finish_reason, usage = False, None, None
        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        try:
            chunks = self.chat.chunks(chat_request, stream.request_id, stream, how)
            async with aclosing(chunks) as chunks:
                async for chunk in chunks:
                    if chunk.usage is not None and not chunk.choices:
                        usage = chunk.usage
                        continue
                    choice = chunk.choices[0]
                    finish_reason = choice.finish_reason or finish_reason
                    for call in choice.delta.tool_calls or []:
                        calls.append(responses_chat.as_call(call))
                    if not choice.delta.content:
                        continue
                    if not opened:
                        opened = True
                        for opening in open_message():
                            yield opening
                    new = responses_chat.output_logprobs(choice.logprobs, request) or []
                    text += choice.delta.content
                    logprobs += new
                    new_dumped = [dump(p) for p in new]
                    yield event("response.output_text.delta", **where,
                                delta=choice.delta.content, logprobs=new_dumped)  # fmt: skip
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
            part = OutputText(
                text=text, logprobs=logprobs if responses_chat.wants_logprobs(request) else None
            )
            message = responses_chat.output_message(message_id, part, incomplete)
            for opening in [] if opened else open_message():
                yield opening
            yield event("response.output_text.done", **where, text=text,
                        logprobs=[dump(p) for p in part.logprobs or []])  # fmt: skip
            yield event("response.content_part.done", **where, part=dump(part))
            yield event("response.output_item.done", output_index=0, item=dump(message))
            items.append(message)
        for call in calls:
            item = responses_chat.function_call(call)
            at = {"item_id": item.id, "output_index": len(items)}
            opening = item.model_copy(update={"arguments": "", "status": "in_progress"})
            yield event("response.output_item.added", output_index=len(items), item=dump(opening))
            yield event("response.function_call_arguments.delta", **at, delta=item.arguments)
            yield event("response.function_call_arguments.done", **at, arguments=item.arguments)
            yield event("response.output_item.done", output_index=len(items), item=dump(item))
            items.append(item)
        final = responses_chat.response_object(
            request, model, response_id, items, usage, incomplete, stored
        )
        self._keep(request, final, conversation)
        kind = "response.incomplete" if incomplete else "response.completed"
        yield event(kind, response=dump(final))

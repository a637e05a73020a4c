"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from llmserve.engine.request_stream import RequestStream
from llmserve.entrypoints.openai import tool_calls
from llmserve.entrypoints.openai.errors import OpenAIError
from llmserve.entrypoints.openai.logprobs import chat_logprobs
from llmserve.entrypoints.openai.protocol import (
    ChatMessage,
    ToolCall,
    UsageInfo,
)
from llmserve.entrypoints.openai.protocol_chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from llmserve.entrypoints.openai.sampling import chat_params
from llmserve.entrypoints.openai.serving_base import (
    SSE_DONE,
    ChoiceProgress,
    EventStream,
    ServingBase,
    random_id,
    sse,
    sse_error,
)
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.tokenizer import reserved_template_kwargs


class OpenAIServingChat(ServingBase):
    """Builds chat completion responses and stream chunks from engine outputs."""

    async def create(self, request: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        """Queue the conversation; a response, or (``stream``) an SSE event stream."""
        request_id, stream, how = await self.queue(request)
        if request.stream:
            return EventStream(self._stream(request, request_id, stream, how), [stream])
        (out,) = await self.final_outputs([stream])
        return self.response(request, request_id, how, out)

    async def queue(
        self, request: ChatCompletionRequest, request_id: str | None = None
    ) -> tuple[str, RequestStream, str]:
        """Template the conversation and queue it under ``request_id`` (default: a new
        chatcmpl-... id): (the id, its stream, the tool mode)."""
        lora = self.check_model(request.model)
        how = tool_calls.mode(request)
        tool_calls.check_tools(request)
        messages, tools = tool_calls.conversation(request, self.template_has_tools, how)
        prompt_ids = self.apply_chat_template(
            messages,
            request.add_generation_prompt,
            tools,
            request.continue_final_message,
            request.chat_template_kwargs,
        )
        schema = tool_calls.call_schema(request, how)
        params = chat_params(request, self.vocab_size, schema, self.sampling_defaults)
        request_id = request_id or random_id("chatcmpl")
        prompt = {"prompt_token_ids": prompt_ids}
        (stream,) = await self.add_all(
            request_id, [prompt], params, request.priority, request.cache_salt, lora
        )
        return request_id, stream, how

    def response(
        self, request: ChatCompletionRequest, request_id: str, how: str, out: RequestOutput
    ) -> ChatCompletionResponse:
        """The whole reply to a request that did not stream."""
        echoed = _echoed(request)
        choices = []
        for c in out.outputs:
            content, calls, finish_reason = _reply(request, how, c)
            if request.echo:
                content = echoed + (content or "")
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=content, tool_calls=calls or None),
                    logprobs=self._logprobs(request, c, 0),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.reply_model(request.model),
            choices=choices,
            usage=self.usage([out]),
            prompt_token_ids=out.prompt_token_ids if request.return_token_ids else None,
        )

    @property
    def template_has_tools(self) -> bool:
        """Whether the model's chat template renders a ``tools`` list itself."""
        return "tools" in (self.tokenizer.chat_template or "")

    def apply_chat_template(
        self,
        messages: list[ChatMessage] | list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the templated conversation (``continue_final_message``: the last
        message left open, for the reply to continue it; ``template_kwargs``: more variables
        for the template, such as ``enable_thinking``); a template error is a 400."""
        reserved = reserved_template_kwargs(template_kwargs)
        if reserved:
            raise OpenAIError(
                f"chat_template_kwargs cannot set {reserved}: they are the request's own fields "
                "or the templating call's",
                param="chat_template_kwargs",
            )
        check_continuation(continue_final_message, add_generation_prompt)
        conversation = [
            m if isinstance(m, dict) else tool_calls.message_dict(m, self.template_has_tools)
            for m in messages
        ]
        extra: dict = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        if continue_final_message:
            extra["continue_final_message"] = True
        try:
            return list(
                self.tokenizer.apply_chat_template(
                    conversation,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=True,
                    return_dict=False,
                    **extra,
                )
            )
        except Exception as e:  # jinja errors: roles the template rejects, and the like
            raise OpenAIError(
                f"the chat template cannot format these messages: {e}", param="messages"
            ) from e

    def _logprobs(
        self, request: ChatCompletionRequest, c: CompletionOutput, first_token: int
    ) -> ChatLogProbs | None:
        if not request.logprobs:
            return None
        return chat_logprobs(
            c.token_ids[first_token:],
            (c.logprobs or [])[first_token:],
            request.top_logprobs or 0,
            self.token_texts(request),
        )

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, stream: RequestStream, how: str
    ) -> AsyncIterator[str]:
        try:
            async with aclosing(self._events(request, request_id, stream, how)) as events:
                async for event in events:
                    yield event
        except Exception as e:  # the engine failed mid-stream: say so, then end the stream
            yield sse_error(e)
            yield SSE_DONE
        finally:
            self.abort([stream])

    async def _events(
        self, request: ChatCompletionRequest, request_id: str, stream: RequestStream, how: str
    ) -> AsyncIterator[str]:
        async with aclosing(self.chunks(request, request_id, stream, how)) as chunks:
            async for chunk in chunks:
                yield sse(chunk.model_dump_json())
        yield SSE_DONE

    async def chunks(
        self, request: ChatCompletionRequest, request_id: str, stream: RequestStream, how: str
    ) -> AsyncIterator[ChatCompletionChunk]:
        """The stream's chunks as objects (the role first, then text as it comes; with tools,
        the reply at its end; the usage last where stream_options asks)."""

        def event(
            choices: list[ChatStreamChoice],
            usage: UsageInfo | None = None,
            prompt_token_ids: list[int] | None = None,
        ) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=request_id,
                created=created,
                model=self.reply_model(request.model),
                choices=choices,
                usage=usage,
                prompt_token_ids=prompt_token_ids,
            )

        created = int(time.time())
        echoed = _echoed(request)
        progress: dict[int, ChoiceProgress] = {}
        out: RequestOutput | None = None
        async with aclosing(self.merged([stream])) as outputs:
            async for _, out in outputs:
                for c in out.outputs:
                    if c.index not in progress:
                        progress[c.index] = ChoiceProgress()
                        role = DeltaMessage(role="assistant", content="")
                        first = len(progress) == 1  # the stream's first chunk
                        ids = request.return_token_ids and first
                        prompt_ids = out.prompt_token_ids if ids else None
                        usage = self.running_usage(request, out, None)
                        yield event(
                            [ChatStreamChoice(index=c.index, delta=role)], usage, prompt_ids
                        )
                        if echoed:
                            echo = DeltaMessage(content=echoed)
                            yield event([ChatStreamChoice(index=c.index, delta=echo)], usage)
                    if how != "none":  # tools: held back until the reply is known
                        choice = self._tool_chunk_choice(request, how, progress[c.index], c)
                    else:
                        choice = self._chunk_choice(request, progress[c.index], c)
                    if choice is not None:
                        yield event([choice], self.running_usage(request, out, c))
        if out is not None and request.stream_options and request.stream_options.include_usage:
            yield event([], self.usage([out]))

    def _chunk_choice(
        self, request: ChatCompletionRequest, state: ChoiceProgress, c: CompletionOutput
    ) -> ChatStreamChoice | None:
        advanced = state.advance(c, with_tokens=request.logprobs or request.return_token_ids)
        if advanced is None:
            return None
        delta, first_token = advanced
        return ChatStreamChoice(
            index=c.index,
            delta=DeltaMessage(content=delta),
            logprobs=self._logprobs(request, c, first_token),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=_new_token_ids(request, c, first_token),
        )

    def _tool_chunk_choice(
        self, request: ChatCompletionRequest, how: str, state: ChoiceProgress, c: CompletionOutput
    ) -> ChatStreamChoice | None:
        if c.finish_reason is None:
            return None
        advanced = state.advance(c, with_tokens=request.logprobs or request.return_token_ids)
        first_token = advanced[1] if advanced is not None else 0
        content, calls, finish_reason = _reply(request, how, c)
        deltas = [
            DeltaToolCall(
                index=i,
                id=call.id,
                type="function",
                function=DeltaFunctionCall(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for i, call in enumerate(calls)
        ]
        return ChatStreamChoice(
            index=c.index,
            delta=DeltaMessage(content=content, tool_calls=deltas or None),
            logprobs=self._logprobs(request, c, first_token),
            finish_reason=finish_reason,
            stop_reason=c.stop_reason,
            token_ids=_new_token_ids(request, c, first_token),
        )


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """The schema's rule: continuing the last message asks for no new turn."""
    if continue_final_message and add_generation_prompt:
        raise OpenAIError(
            "continue_final_message and add_generation_prompt cannot both be true: set "
            "add_generation_prompt to false to continue the last message",
            param="continue_final_message",
        )


def _echoed(request: ChatCompletionRequest) -> str:
    """What ``echo`` puts before the reply, as vLLM: the last message's text (as the template
    saw it) when it has the reply's role (the assistant's; with add_generation_prompt false,
    the last message's own); empty without ``echo``."""
    last = request.messages[-1]
    role = "assistant" if request.add_generation_prompt else last.role
    return tool_calls.message_text(last) if request.echo and last.role == role else ""


def _new_token_ids(
    request: ChatCompletionRequest, c: CompletionOutput, first_token: int
) -> list[int] | None:
    """A chunk's new tokens where the request asked for token ids (return_token_ids)."""
    return list(c.token_ids[first_token:]) if request.return_token_ids else None


def _reply(
    request: ChatCompletionRequest, how: str, c: CompletionOutput
) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish_reason) of a finished choice."""
    if how == "none" or c.finish_reason != "stop":
        return c.text, [], c.finish_reason  # no tools, or cut short: the text as it is
    if how in ("required", "named"):
        return None, tool_calls.parse_constrained(c.text), "tool_calls"
    content, calls = tool_calls.parse_auto(c.text, request)
    return content, calls, "tool_calls" if calls else c.finish_reason

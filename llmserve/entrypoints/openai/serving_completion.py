"""POST /v1/completions: text or token-id prompts, one or many, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from llmserve.engine.llm_engine import PromptType
from llmserve.engine.request_stream import RequestStream
from llmserve.entrypoints.openai.errors import OpenAIError
from llmserve.entrypoints.openai.logprobs import completion_logprobs, merge_completion_logprobs
from llmserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from llmserve.entrypoints.openai.sampling import completion_params
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

MAX_PROMPTS = 256  # most prompts in one request


class OpenAIServingCompletion(ServingBase):
    """Builds completion responses and stream chunks from engine outputs."""

    async def create(self, request: CompletionRequest) -> CompletionResponse | EventStream:
        """Queue the prompts; a response, or (``stream``) an SSE event stream."""
        lora = self.check_model(request.model)
        prompts = _prompts(request.prompt)
        params = completion_params(request, self.vocab_size, self.sampling_defaults)
        request_id = random_id("cmpl")
        streams = await self.add_all(
            request_id, prompts, params, request.priority, request.cache_salt, lora
        )
        if request.stream:
            return EventStream(self._stream(request, request_id, streams), streams)
        outputs = await self.final_outputs(streams)
        choices = [
            self._choice(request, i * request.n + c.index, out, c)
            for i, out in enumerate(outputs)
            for c in out.outputs
        ]
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=request_id,
            model=self.reply_model(request.model),
            choices=choices,
            usage=self.usage(outputs),
        )

    def _choice(
        self, request: CompletionRequest, index: int, out: RequestOutput, c: CompletionOutput
    ) -> CompletionChoice:
        text = (self._prompt_text(out) if request.echo else "") + c.text
        logprobs = None
        if request.logprobs is not None:
            logprobs = self._logprobs(request, out, c, 0, with_prompt=request.echo)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if request.return_token_ids else None,
            prompt_token_ids=out.prompt_token_ids if request.return_token_ids else None,
        )

    def _logprobs(
        self,
        request: CompletionRequest,
        out: RequestOutput,
        c: CompletionOutput,
        first_token: int,
        with_prompt: bool,
        offset: int = 0,
    ) -> CompletionLogProbs:
        num_top = request.logprobs or 0
        texts = self.token_texts(request)
        result = CompletionLogProbs()
        if with_prompt and out.prompt_logprobs is not None:
            result = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, num_top, texts)
            offset = len(self._prompt_text(out))
        generated = completion_logprobs(
            c.token_ids[first_token:], (c.logprobs or [])[first_token:], num_top, texts, offset
        )
        merge_completion_logprobs(result, generated)
        return result

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    async def _stream(
        self, request: CompletionRequest, request_id: str, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        try:
            async with aclosing(self._events(request, request_id, streams)) as events:
                async for event in events:
                    yield event
        except Exception as e:  # the engine failed mid-stream: say so, then end the stream
            yield sse_error(e)
            yield SSE_DONE
        finally:
            self.abort(streams)

    async def _events(
        self, request: CompletionRequest, request_id: str, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        def event(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            body = CompletionResponse(
                id=request_id,
                created=created,
                model=self.reply_model(request.model),
                choices=choices,
                usage=usage,
            )
            return sse(body.model_dump_json())

        created = int(time.time())
        progress: dict[int, ChoiceProgress] = {}
        latest: dict[int, RequestOutput] = {}
        async with aclosing(self.merged(streams)) as outputs:
            async for i, out in outputs:
                latest[i] = out
                for c in out.outputs:
                    chunk = self._chunk(request, progress, i * request.n + c.index, out, c)
                    if chunk is not None:
                        yield event([chunk], self.running_usage(request, out, c))
        if request.stream_options and request.stream_options.include_usage:
            yield event([], self.usage(list(latest.values())))
        yield SSE_DONE

    def _chunk(
        self,
        request: CompletionRequest,
        progress: dict[int, ChoiceProgress],
        index: int,
        out: RequestOutput,
        c: CompletionOutput,
    ) -> CompletionChoice | None:
        is_first = index not in progress
        state = progress.setdefault(index, ChoiceProgress())
        offset = state.num_chars + (len(self._prompt_text(out)) if request.echo else 0)
        with_tokens = request.logprobs is not None or request.return_token_ids
        advanced = state.advance(c, with_tokens=with_tokens)
        if advanced is None:
            return None
        delta, first_token = advanced
        if is_first and request.echo:
            delta = self._prompt_text(out) + delta
        logprobs = None
        if request.logprobs is not None:
            with_prompt = is_first and request.echo
            logprobs = self._logprobs(request, out, c, first_token, with_prompt, offset)
        ids = request.return_token_ids
        return CompletionChoice(
            index=index,
            text=delta,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids[first_token:]) if ids else None,
            prompt_token_ids=out.prompt_token_ids if ids and is_first else None,
        )


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """One engine prompt per entry: text, or ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    if len(prompt) > MAX_PROMPTS:
        raise OpenAIError(
            f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed", param="prompt"
        )
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]

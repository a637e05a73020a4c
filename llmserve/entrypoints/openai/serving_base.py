"""What both generation endpoints share: model check, queueing, collecting and merging streams.

A request with several prompts becomes one engine request per prompt (``<id>-0``, ``<id>-1``
...); every exit path, client disconnect included, aborts the ones still running.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from llmserve.engine.async_engine import AsyncLLMEngine
from llmserve.engine.llm_engine import PromptType
from llmserve.engine.request_stream import RequestStream
from llmserve.entrypoints.openai.errors import error_from_exception
from llmserve.entrypoints.openai.logprobs import TokenIdTexts, TokenTexts
from llmserve.entrypoints.openai.protocol import ErrorResponse, PromptTokensDetails, UsageInfo
from llmserve.entrypoints.openai.serving_models import ServingModels
from llmserve.lora.request import LoRARequest
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger("llmserve.requests")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: str) -> str:
    """One server-sent event."""
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(e: Exception) -> str:
    """The event that tells a streaming client its request failed after the stream began."""
    error = error_from_exception(e)
    body = {"message": error.message, "type": "server_error", "param": None, "code": error.status}
    return sse(ErrorResponse.model_validate({"error": body}).model_dump_json())


@dataclass(frozen=True)
class ServingOptions:
    """Server-wide choices (``llmserve serve``'s flags) that the endpoints apply."""

    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids
    log_requests: bool = False  # --enable-log-requests
    max_log_len: int | None = None  # --max-log-len: most prompt characters or ids logged
    store_responses: bool = False  # --enable-responses-store: /v1/responses keeps its replies


@dataclass
class EventStream:
    """An SSE body and the engine streams behind it, to abort when the response ends."""

    events: AsyncIterator[str]
    streams: list[RequestStream]


@dataclass
class ChoiceProgress:
    """How much of one streamed choice the client has seen."""

    num_chars: int = 0
    num_tokens: int = 0
    is_finished: bool = False

    def advance(self, output: CompletionOutput, with_tokens: bool) -> tuple[str, int] | None:
        """The new text and the index of the first new token; None when nothing is new."""
        if self.is_finished:
            return None
        delta = output.text[self.num_chars :]
        first_token = self.num_tokens
        has_new_tokens = len(output.token_ids) > first_token
        if not delta and not output.finished and not (with_tokens and has_new_tokens):
            return None
        self.num_chars = max(self.num_chars, len(output.text))
        self.num_tokens = len(output.token_ids)
        self.is_finished = output.finished
        return delta, first_token


class ServingBase:
    """Holds the engine and what the endpoints read from it."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        models: ServingModels,
        options: ServingOptions | None = None,
    ) -> None:
        self.engine = engine
        self.models = models
        self.model_name = models.base_names[0]
        self.options = options or ServingOptions()
        self.tokenizer = engine.engine.tokenizer
        self.texts = TokenTexts(self.tokenizer)
        self.id_texts = TokenIdTexts()
        self.vocab_size: int = engine.engine.hf_config.vocab_size
        self.sampling_defaults: dict[str, Any] = engine.engine.sampling_defaults

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter ``name`` picks (None: the base model; no name means the base
        model); 404 for a model this server does not serve."""
        return self.models.resolve(name)

    def reply_model(self, name: str | None) -> str:
        """The ``model`` of a reply to a request that named ``name``."""
        return self.models.reply_name(name)

    def token_texts(self, request: Any) -> TokenTexts:
        """How this request's logprobs name tokens: their text, or ``token_id:N``."""
        as_ids = request.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.options.return_tokens_as_token_ids
        return self.id_texts if as_ids else self.texts

    async def add_all(
        self,
        request_id: str,
        prompts: list[PromptType],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """Queue one engine request per prompt (each with ``cache_salt``, where given, and
        ``lora_request``'s adapter); if any is refused, none stays queued."""
        if cache_salt is not None:
            prompts = [_as_dict(p) | {"cache_salt": cache_salt} for p in prompts]
        streams: list[RequestStream] = []
        try:
            if params.structured_outputs is not None:  # compile here, not on the engine's loop
                grammars = self.engine.engine.grammars
                await asyncio.to_thread(grammars.compile, params.structured_outputs)
            for i, prompt in enumerate(prompts):
                request_id_i = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                if self.options.log_requests:
                    self._log_request(request_id_i, prompt, params)
                streams.append(
                    await self.engine.add_request(
                        request_id_i, prompt, params, priority, lora_request
                    )
                )
        except Exception as e:
            self.abort(streams)
            raise error_from_exception(e) from e
        except BaseException:
            self.abort(streams)
            raise
        return streams

    def _log_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        """One line per engine request (--enable-log-requests), the prompt cut to
        --max-log-len characters or ids."""
        as_dict = _as_dict(prompt)
        text, ids = as_dict.get("prompt"), as_dict.get("prompt_token_ids")
        cut = self.options.max_log_len
        logger.info(
            "Received request %s: prompt: %r, prompt_token_ids: %s, params: %s",
            request_id,
            text[:cut] if text is not None else None,
            list(ids)[:cut] if ids is not None else None,
            params,
        )

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.is_finished:
                self.engine.abort(stream.request_id)

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Wait until every stream finishes; each one's last (complete) output."""
        try:
            return list(await asyncio.gather(*(_last_output(s) for s in streams)))
        except Exception as e:
            raise error_from_exception(e) from e
        finally:
            self.abort(streams)

    async def merged(
        self, streams: list[RequestStream]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(stream index, output) pairs in arrival order, until every stream finishes."""
        if len(streams) == 1:  # the usual request: no task and wait set per token
            while not streams[0].is_finished:
                yield 0, await streams[0].get()
            return
        pending = {asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    i = pending.pop(task)
                    output = task.result()
                    if not streams[i].is_finished:
                        pending[asyncio.ensure_future(streams[i].get())] = i
                    yield i, output
        finally:
            for task in pending:
                task.cancel()

    @staticmethod
    def running_usage(
        request: Any, out: RequestOutput, c: CompletionOutput | None
    ) -> UsageInfo | None:
        """A chunk's usage so far (the prompt's tokens and choice ``c``'s; None: a chunk ahead
        of the choice's tokens), where the request asks for it (vLLM's
        stream_options.continuous_usage_stats)."""
        options = request.stream_options
        if options is None or not options.continuous_usage_stats:
            return None
        num_prompt, num_generated = len(out.prompt_token_ids), len(c.token_ids) if c else 0
        return UsageInfo(
            prompt_tokens=num_prompt,
            completion_tokens=num_generated,
            total_tokens=num_prompt + num_generated,
        )

    @staticmethod
    def usage(outputs: list[RequestOutput]) -> UsageInfo:
        num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
        num_completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return UsageInfo(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(o.num_cached_tokens for o in outputs)
            ),
        )


def _as_dict(prompt: PromptType) -> dict[str, Any]:
    if isinstance(prompt, dict):
        return prompt
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}


async def _last_output(stream: RequestStream) -> RequestOutput:
    output = await stream.get()
    while not stream.is_finished:
        output = await stream.get()
    return output

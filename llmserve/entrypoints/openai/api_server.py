"""The OpenAI-compatible HTTP server: routes, API-key check, client-disconnect aborts.

    POST /v1/completions  POST /v1/chat/completions  POST /v1/responses  GET /v1/models
    GET, DELETE /v1/responses/{id}  GET /v1/models/{name}  POST /tokenize  POST /detokenize
    GET /health (and /ping)  GET /version  GET /metrics  /openapi.json
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter  (VLLM_ALLOW_RUNTIME_LORA_UPDATING)

``llmserve serve [MODEL] --host --port --api-key ...`` starts it (see ``launcher.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.routing import get_route_path
from starlette.types import ASGIApp, Receive, Scope, Send

import llmserve
from llmserve.engine.async_engine import AsyncLLMEngine
from llmserve.engine.request_stream import RequestStream
from llmserve.entrypoints.openai.errors import OpenAIError, error_response, install_error_handlers
from llmserve.entrypoints.openai.metrics import ServerMetrics
from llmserve.entrypoints.openai.openapi_document import openapi_schema
from llmserve.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    dump,
)
from llmserve.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from llmserve.entrypoints.openai.protocol_responses import (
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from llmserve.entrypoints.openai.serving_base import EventStream, ServingBase, ServingOptions
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat, check_continuation
from llmserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmserve.entrypoints.openai.serving_models import (
    ServingModels,
    lora_router,
    runtime_updates_allowed,
)
from llmserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from llmserve.entrypoints.openai.stats_logger import StatsLogger, log_interval_s

T = TypeVar("T")
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")  # health, metrics, docs stay open
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 503)
}

router = APIRouter()


@dataclass
class ServerState:
    """What the routes need: the engine, the serving layers, the metrics."""

    engine: AsyncLLMEngine
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses
    metrics: ServerMetrics
    models: ServingModels  # the base model's names and the LoRA adapters'


def build_app(
    engine: AsyncLLMEngine,
    api_key: str | None = None,
    model_names: list[str] | None = None,
    allowed_origins: list[str] | None = None,
    options: ServingOptions | None = None,
    log_stats: bool = True,
    docs: bool = True,
    lora_modules: list[tuple[str, str, str | None]] = (),
) -> FastAPI:
    """The FastAPI app; the engine thread starts and stops with the app's lifespan.
    ``allowed_origins``: the origins whose pages a browser lets call the API (CORS; ``*``:
    any); none: no CORS headers at all. ``options``: the endpoints' server-wide choices;
    ``log_stats``: the periodic stats line (stats_logger.py); ``docs``: /docs, /redoc and
    /openapi.json. ``lora_modules``: (name, path, base model name) of each LoRA adapter
    served (``--lora-modules``; the engine needs ``enable_lora``)."""
    lora = engine.engine.config.lora
    models = ServingModels(
        model_names or [engine.engine.model_name],
        lora.max_lora_rank if lora.enable_lora else None,
    )
    for name, path, base_model_name in lora_modules:
        models.add(name, path, base_model_name)
    chat = OpenAIServingChat(engine, models, options)
    state = ServerState(
        engine=engine,
        completion=OpenAIServingCompletion(engine, models, options),
        chat=chat,
        responses=OpenAIServingResponses(chat),
        metrics=ServerMetrics(engine),
        models=models,
    )
    interval_s = log_interval_s() if log_stats else None  # a bad value refused before start

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        stats = None
        if interval_s is not None:
            stats = asyncio.get_running_loop().create_task(StatsLogger(engine).run(interval_s))
        yield
        if stats is not None:
            stats.cancel()
        await asyncio.to_thread(engine.stop)

    hidden = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="llmserve", version=llmserve.__version__, lifespan=lifespan, **hidden)
    app.state.llmserve = state
    app.openapi = lambda: openapi_schema(app, engine.engine, chat.options.store_responses)
    app.include_router(router)
    if lora.enable_lora and runtime_updates_allowed():
        app.include_router(lora_router)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:  # outermost: a preflight (OPTIONS, no key) is answered before the key check
        app.add_middleware(
            CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    return app


class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` on the API routes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # the path as routes see it (behind --root-path it may carry the prefix)
        if scope["type"] == "http" and get_route_path(scope).startswith(_PROTECTED_PREFIXES):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "Missing API key" if not given else "Incorrect API key provided"
                response = error_response(401, message, code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _state(raw: Request) -> ServerState:
    return raw.app.state.llmserve


# ---- generation ---------------------------------------------------------------------------
def _sse(description: str) -> dict[str, Any]:
    """The OpenAPI content of a streamed reply: server-sent events, as ``description`` says."""
    schema = {
        "type": "object",
        "description": description,
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        "required": ["data"],
    }
    return {"text/event-stream": {"schema": schema}}


_SSE = _sse(  # with stream: true, one event per chunk, `data: [DONE]` last
    "one server-sent event: `data: <chunk JSON>` (a completion or chat.completion.chunk "
    "object), or `data: [DONE]` at the end"
)
_RESPONSE_EVENTS = _sse(  # with stream: true, the Responses API's typed events
    "one server-sent event: `event: <type>` and `data: <event JSON>` (response.created, "
    "response.output_text.delta, ..., response.completed)"
)


@router.post(
    "/v1/completions",
    responses={200: {"model": CompletionResponse, "content": _SSE}, **_ERRORS},
)
async def create_completion(request: CompletionRequest, raw: Request) -> Response:
    """Complete one or more prompts (``stream`` for server-sent events)."""
    serving = _state(raw).completion
    return _respond(serving, await _until_disconnect(raw, serving.create(request)))


@router.post(
    "/v1/chat/completions",
    responses={200: {"model": ChatCompletionResponse, "content": _SSE}, **_ERRORS},
)
async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
    """Answer a conversation (``stream`` for server-sent events)."""
    serving = _state(raw).chat
    return _respond(serving, await _until_disconnect(raw, serving.create(request)))


@router.post(
    "/v1/responses",
    responses={200: {"model": ResponseObject, "content": _RESPONSE_EVENTS}, **_ERRORS},
)
async def create_response(request: ResponsesRequest, raw: Request) -> Response:
    """Answer ``input`` as OpenAI's Responses API (``stream`` for its typed events)."""
    serving = _state(raw).responses
    return _respond(serving, await _until_disconnect(raw, serving.create(request)))


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERRORS)
async def retrieve_response(response_id: str, raw: Request) -> ResponseObject:
    """A stored response (``--enable-responses-store``)."""
    return _state(raw).responses.retrieve(response_id)


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=_ERRORS)
async def delete_response(response_id: str, raw: Request) -> ResponseDeleted:
    """Forget a stored response."""
    return _state(raw).responses.delete(response_id)


def _respond(serving: ServingBase | OpenAIServingResponses, result: Any) -> Response:
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    if isinstance(result, EventStream):
        return StreamingResponse(
            result.events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(_abort, serving, result.streams),
        )
    return JSONResponse(dump(result))


async def _abort(
    serving: ServingBase | OpenAIServingResponses, streams: list[RequestStream]
) -> None:
    """Async, so that starlette runs it on the loop rather than through a worker thread."""
    serving.abort(streams)


async def _until_disconnect(raw: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; if the client disconnects first, cancel it (aborting its requests)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch_task):
            task.cancel()
    if not work_task.cancelled() and work_task.done():
        return work_task.result()
    await asyncio.gather(work_task, return_exceptions=True)
    return None


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


# ---- models, tokenizer, health ------------------------------------------------------------
@router.get("/v1/models", response_model=ModelList)
async def list_models(raw: Request) -> ModelList:
    """The models this server serves: the base model, then its LoRA adapters."""
    return ModelList(data=_model_cards(_state(raw)))


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
async def retrieve_model(model: str, raw: Request) -> ModelCard:
    """One served model by name (OpenAI's ``models.retrieve``); 404 for any other name."""
    state = _state(raw)
    state.chat.check_model(model)
    return next(card for card in _model_cards(state) if card.id == model)


def _model_cards(state: ServerState) -> list[ModelCard]:
    engine = state.engine.engine
    root = engine.config.model.model or engine.resolved.display_name
    return state.models.cards(root, engine.max_model_len)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(request: TokenizeRequest, raw: Request) -> TokenizeResponse:
    """Token ids of a text prompt, or of chat messages after the chat template."""
    state = _state(raw)
    state.chat.check_model(request.model)
    check_continuation(request.continue_final_message, request.add_generation_prompt)
    if request.messages is not None:
        tokens = state.chat.apply_chat_template(
            request.messages,
            request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.chat_template_kwargs,
        )
    elif request.prompt is not None:
        tokens = state.chat.tokenizer.encode(
            request.prompt, add_special_tokens=request.add_special_tokens
        )
    else:
        raise OpenAIError("give prompt (text) or messages", param="prompt")
    max_model_len = state.engine.engine.max_model_len
    strs = state.chat.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=max_model_len, tokens=tokens, token_strs=strs
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize(request: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    """Text of token ids."""
    serving = _state(raw).chat
    serving.check_model(request.model)
    bad = [t for t in request.tokens if not 0 <= t < serving.vocab_size]
    if bad:
        raise OpenAIError(
            f"token ids {bad[:5]} are outside the vocabulary [0, {serving.vocab_size})",
            param="tokens",
        )
    return DetokenizeResponse(prompt=serving.tokenizer.decode(request.tokens))


_HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {"schema": {"type": "object"}}}},
    503: {"model": ErrorResponse},
}


@router.get("/health", responses=_HEALTH_RESPONSES)
async def health(raw: Request) -> Response:
    """200 while the engine thread runs, 503 once it stopped."""
    if not _state(raw).engine.is_alive:
        return error_response(503, "the engine is not running")
    return JSONResponse({"status": "ok"})


router.add_api_route(  # vLLM's alias of /health (SageMaker's health check)
    "/ping", health, methods=["GET", "POST"], responses=_HEALTH_RESPONSES
)


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    return VersionResponse(version=llmserve.__version__)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(raw: Request) -> Response:
    """Prometheus text format."""
    server_metrics = _state(raw).metrics
    return Response(server_metrics.render(), media_type=server_metrics.content_type)


# ---- command line ---------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``llmserve serve``: discovered by ``llmserve.entrypoints.cli.build_parser``."""
    from llmserve.entrypoints.openai.launcher import add_serve_parser

    return add_serve_parser(subparsers)

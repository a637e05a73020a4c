"""``llmserve serve``: flags, start-up (model, KV arithmetic, URL) and a clean shutdown.

The engine runs in a thread of the server's process (``engine/async_engine.py``);
``--engine-core-process`` runs it in a process of its own (``engine/core_process.py``, vLLM's
design), and ``--data-parallel-size N`` runs N engines as Ray actors.

SIGINT / SIGTERM: the server stops taking requests, ends those in flight with
``finish_reason: "abort"`` (streams still get ``data: [DONE]``), waits for the responses to
go out, stops the engine and exits 0.

uvicorn picks uvloop and httptools (dependencies) over asyncio and h11 when they import, as
vLLM's server does: the event loop shares two cores with the engine's kernel threads, so its
CPU per streamed chunk is taken from the forward step.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from llmserve.entrypoints.engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger("llmserve.serve")

GRACEFUL_SHUTDOWN_S = 30


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The ``serve`` subcommand: server flags, then every engine flag from the config."""
    p = subparsers.add_parser("serve", help="Start the OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, help="model (same as --model)")
    server = p.add_argument_group("Server", "HTTP server options")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    server.add_argument(
        "--api-key",
        default=os.environ.get("LLMSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $LLMSERVE_API_KEY, or none)",
    )
    server.add_argument(
        "--max-num-waiting",
        type=int,
        default=1024,
        help="answer 503 (Retry-After) while this many requests wait (default: 1024)",
    )
    server.add_argument(
        "--engine-core-process",
        action="store_true",
        help="run the engine in a process of its own, HTTP in this one (vLLM's design; "
        "engine/core_process.py); default: the engine in a thread of this process",
    )
    server.add_argument(
        "--allowed-origins",
        default="*",
        help="origins a browser page may call the API from (CORS), comma-separated, or '' for "
        "none (default: *, any, as vLLM's)",
    )
    server.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name tokens 'token_id:N' instead of their text, unless a request says "
        "otherwise (return_tokens_as_token_ids), as vLLM's flag",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served beside the model (with --enable-lora), each as name=path "
        'or JSON {"name": ..., "path": ..., "base_model_name": ...}; a request picks one by '
        "its model field (vLLM's flag)",
    )
    server.add_argument(
        "--enable-responses-store",
        action="store_true",
        help="keep the newest 1024 replies of /v1/responses in memory for previous_response_id "
        "and GET /v1/responses/{id} (vLLM: VLLM_ENABLE_RESPONSES_API_STORE=1); default: "
        "nothing is stored, as vLLM's default",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="the chat template for chat requests instead of the model's own: a Jinja file, "
        "or the template itself (vLLM's flag)",
    )
    server.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request as it arrives: id, prompt, sampling parameters (vLLM's flag)",
    )
    server.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="requests are not logged unless --enable-log-requests (vLLM's older flag, "
        "accepted so its command lines run)",
    )
    server.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="most prompt characters (or token ids) a logged request shows (default: all)",
    )
    server.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (throughput, batch, KV cache; every "
        "$LLMSERVE_LOG_STATS_INTERVAL seconds, default 10)",
    )
    server.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no /docs, /redoc or /openapi.json (vLLM's flag)",
    )
    server.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a reverse proxy serves the API under (FastAPI's root_path)",
    )
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file")
    server.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file")
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="tool_choice 'auto' is always on here (vLLM's flag, accepted so its command lines "
        "run)",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=["hermes"],
        default=None,
        help="the tool-call format the model writes: 'hermes' (<tool_call>{...}</tool_call>), "
        "the only one read here and the default",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: info)",
    )
    add_engine_args(p)
    p.set_defaults(func=run_server)
    return p


def run_server(args: argparse.Namespace) -> int:
    """Load the model, then serve until SIGINT / SIGTERM."""
    from llmserve.config import EngineConfig
    from llmserve.engine.async_engine import AsyncLLMEngine
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.entrypoints.openai.api_server import build_app
    from llmserve.entrypoints.openai.serving_base import ServingOptions
    from llmserve.entrypoints.openai.serving_models import parse_lora_modules

    kwargs = engine_kwargs(args)
    if args.model_tag is not None:
        if kwargs.get("model") not in (None, args.model_tag):
            raise ValueError(
                f"two models given: {args.model_tag!r} and --model {kwargs['model']!r}"
            )
        kwargs["model"] = args.model_tag
    if args.max_num_waiting < 1:
        raise ValueError(f"--max-num-waiting must be >= 1, got {args.max_num_waiting}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    lora_modules = parse_lora_modules(args.lora_modules)
    config = EngineConfig.from_kwargs(**kwargs)
    if config.parallel.data_parallel_size > 1:  # N replicas on Ray (llmserve/distributed/)
        from llmserve.distributed.data_parallel import DataParallelEngine

        async_engine = DataParallelEngine(config, max_num_waiting=args.max_num_waiting)
        engine = async_engine.engine
    elif args.engine_core_process:  # the model in a process of its own (engine/core_process.py)
        from llmserve.engine.core_client import EngineCoreClient

        async_engine = EngineCoreClient(config, max_num_waiting=args.max_num_waiting)
        engine = async_engine.engine
    else:
        async_engine = AsyncLLMEngine.build(lambda: LLMEngine(config), args.max_num_waiting)
        engine = async_engine.engine
    if chat_template is not None:
        use_chat_template(engine.tokenizer, chat_template)
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    options = ServingOptions(
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        store_responses=args.enable_responses_store,
    )
    app = build_app(
        async_engine,
        api_key=args.api_key,
        allowed_origins=origins,
        options=options,
        log_stats=not args.disable_log_stats,
        docs=not args.disable_fastapi_docs,
        lora_modules=lora_modules,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    server = GracefulServer(config, on_exit=async_engine.begin_shutdown)
    logger.info(
        "model %r served as %r; %s", engine.resolved.weights_path, engine.model_name, engine.kv_info
    )
    logger.info(
        "OpenAI-compatible API at %s://%s:%d%s/v1 (API key %s)",
        "https" if args.ssl_certfile else "http",
        args.host,
        args.port,
        args.root_path or "",
        "required" if args.api_key else "not required",
    )
    _ignore_reraised_signals()
    server.run()
    logger.info("server stopped")
    return 0 if server.started else 1


def read_chat_template(value: str) -> str:
    """--chat-template's value: a file's text, or the template given inline (it has a Jinja
    tag); a path that names no file is an error."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"--chat-template {value!r}: no such file, and not a Jinja template itself (no {{{{ or "
        "{%); give a template file or the template text"
    )


def use_chat_template(tokenizer: Any, template: str) -> None:
    """Make ``template`` the tokenizer's chat template, once it renders a one-message
    conversation (a broken template stops the start-up, not each chat request)."""
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], chat_template=template, tokenize=False
        )
    except Exception as e:
        raise ValueError(f"--chat-template cannot render a conversation: {e}") from e
    tokenizer.chat_template = template


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: the event loop and HTTP protocol it runs on, logged once it listens;
    on the first SIGINT / SIGTERM, end the requests in flight."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:  # it could not listen (uvicorn logged why)
            return
        loop = type(asyncio.get_running_loop())
        protocol = self.config.http_protocol_class
        logger.info(
            "event loop %s.%s, HTTP protocol %s.%s",
            loop.__module__, loop.__qualname__, protocol.__module__, protocol.__qualname__,
        )  # fmt: skip

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("signal %s: finishing in-flight requests and shutting down", sig)
            self._on_exit()
        super().handle_exit(sig, frame)


def _ignore_reraised_signals() -> None:
    """uvicorn re-raises the signal it caught once it is done; exit 0 instead of dying by it."""

    def _noop(sig: int, frame: FrameType | None) -> None:
        logger.debug("signal %s after shutdown ignored", sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _noop)

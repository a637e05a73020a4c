"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Bad input is a 400 (malformed JSON and wrong types too, never FastAPI's 422), a missing or
wrong API key a 401, an unknown model a 404, back-pressure a 503 with ``Retry-After``.
Anything unexpected is logged and answered with a 500 in the same shape.
"""

from __future__ import annotations

import dataclasses
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve.engine.async_engine import (
    EngineClosedError,
    EngineOverloadedError,
    EngineStepError,
    ReplicaDiedError,
)
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error answered to the client as-is, with its HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The JSON response for an error, in OpenAI's shape."""
    error_type = _ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_from_exception(e: Exception) -> OpenAIError:
    """Map engine and validation exceptions to what the client should see."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        return OpenAIError(str(e), 400, param=_param_of(str(e)))
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(
            str(e), 503, code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(e, EngineClosedError):
        return OpenAIError(str(e), 503, code="shutting_down")
    if isinstance(e, ReplicaDiedError):
        return OpenAIError(
            str(e), 503, code="replica_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(e, EngineStepError):  # its text is the engine's own, meant for the client
        return OpenAIError(str(e), 500, code="engine_error")
    logger.exception("unexpected error", exc_info=e)
    return OpenAIError(f"internal error: {type(e).__name__}", 500)


def _param_of(message: str) -> str | None:
    """SamplingParams errors start with the field name: "top_p must be in (0, 1], got 2"."""
    first_word = message.split(" ", 1)[0]
    return first_word if first_word in _SAMPLING_FIELDS else None


def _is_field(part: Any) -> bool:
    """Keep field names and list indexes of a pydantic location; drop union type tags (the
    types' names: "str", "list[ContentPart]", "NamedToolChoice"; the API's fields are lower
    case)."""
    if isinstance(part, int):
        return True
    return part != "body" and part not in _TYPE_TAGS and "[" not in part and not part[:1].isupper()


def _field_path(error: dict[str, Any]) -> list[str]:
    return [str(part) for part in error.get("loc", ()) if _is_field(part)]


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The first error, or where the field is a union (one error per branch) the branch's
    error that reaches deepest into the value: content given as a list of parts that fails on
    a part's ``type`` says so, rather than that the content is not a string."""
    if not errors:
        return {"msg": "invalid request", "loc": ()}
    field = _field_path(errors[0])
    same_field = [e for e in errors if _field_path(e)[: len(field)] == field]
    # the first of the deepest, a branch whose type the value had (a list that is empty
    # rather than "not a string") before one it had not
    return max(same_field, key=lambda e: (len(_field_path(e)), not _type_mismatch(e)))


def _type_mismatch(error: dict[str, Any]) -> bool:
    kind = str(error.get("type", ""))
    return kind.endswith("_type") or kind in ("none_required", "model_attributes_type")


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """The 400 for a body pydantic refused (``errors()`` of its ValidationError)."""
    message, param = _validation_message(errors)
    return OpenAIError(message, 400, param)


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    first = _most_specific(errors)
    loc = _field_path(first)
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".rstrip(": "), None
    if first.get("type") == "model_attributes_type" and not loc:
        return "The request body must be a JSON object (Content-Type: application/json)", None
    param = loc[0] if loc else None
    where = f"{'.'.join(loc)}: " if loc else ""
    return f"{where}{first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI may raise to an OpenAI-shaped body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        error = validation_error(list(e.errors()))
        return error_response(error.status, error.message, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else HTTPStatus(e.status_code).phrase
        return error_response(e.status_code, message, headers=e.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        error = error_from_exception(e)
        return error_response(error.status, error.message, error.param, error.code, error.headers)

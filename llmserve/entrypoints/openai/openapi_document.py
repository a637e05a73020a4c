"""The OpenAPI document this server publishes (/openapi.json): FastAPI's, with the bounds that
depend on the served model and the server's flags filled in where the request models mark
them (``x-token-id``, ``x-token-id-key``, ``x-stored-responses``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi


def openapi_schema(app: FastAPI, engine: Any, store_responses: bool = False) -> dict[str, Any]:
    """FastAPI's schema, plus this server's own bound: token ids (fields marked x-token-id, and
    logit_bias keys marked x-token-id-key) end at the vocabulary; previous_response_id (marked
    x-stored-responses) takes no value unless the server stores responses."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        last_token = engine.hf_config.vocab_size - 1
        key_pattern = "^" + int_range_pattern(last_token) + "$"

        def fill(node: Any) -> None:
            if isinstance(node, dict):
                if node.pop("x-token-id", False):
                    node["maximum"] = last_token
                if node.pop("x-token-id-key", False):
                    node["pattern"] = key_pattern
                if node.pop("x-stored-responses", False) and not store_responses:
                    node.clear()
                    node["not"] = {}
                for value in node.values():
                    fill(value)
            elif isinstance(node, list):
                for value in node:
                    fill(value)

        fill(schema)
        app.openapi_schema = schema
    return app.openapi_schema


def int_range_pattern(high: int) -> str:
    """A regex matching the decimal integers 0..high (high >= 0), no leading zeros."""
    digits = str(high)
    options = ["0"] + ["[1-9]" + "[0-9]" * (width - 1) for width in range(1, len(digits))]
    for i, d in enumerate(digits):  # as long as high: its prefix, then a smaller digit
        low = 1 if i == 0 else 0
        if int(d) > low:
            options.append(digits[:i] + f"[{low}-{int(d) - 1}]" + "[0-9]" * (len(digits) - i - 1))
    options.append(digits)
    return "(" + "|".join(dict.fromkeys(options)) + ")"

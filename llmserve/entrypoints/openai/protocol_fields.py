"""Request fields of the OpenAI API that take more than a type and bounds: the vLLM extras and
OpenAI fields llmserve refuses rather than ignores (``best_of`` above 1, ``suffix``,
``prompt_logprobs``), ``truncate_prompt_tokens``, ``cache_salt``, ``chat_template_kwargs``,
and the schema rule tying ``continue_final_message`` to ``add_generation_prompt``. Each
refusal says what is allowed; each schema states the same bounds, so the OpenAPI document
matches the server."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

from llmserve.engine.llm_engine import MAX_CACHE_SALT_CHARS, prompt_cache_salt
from llmserve.tokenizer import TEMPLATE_ARGUMENTS


def _integral(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer: accept it as 1 (true, "1" stay refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _best_of_one(value: int) -> int:
    if value > 1:
        raise ValueError(
            "best_of > 1 is not supported (nor by vLLM's V1 engine): leave it out or set 1, or "
            "ask for n completions with logprobs and rank them"
        )
    return value


# OpenAI's legacy best_of (candidates ranked on the server): only 1, its default, is run here;
# refused above it rather than ignored, so nobody is served n plain samples as the best of more
BestOf = Annotated[
    int,
    Field(ge=1, json_schema_extra={"maximum": 1}),
    BeforeValidator(_integral),
    AfterValidator(_best_of_one),
]


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("truncate_prompt_tokens must be >= 1, or -1 (the last max_model_len)")
    return value


# truncate_prompt_tokens: keep the prompt's last k tokens, k >= 1, or -1 for max_model_len
TruncatePrompt = Annotated[
    int,
    Field(ge=-1, json_schema_extra={"not": {"const": 0}}),
    BeforeValidator(_integral),
    AfterValidator(_not_zero),
]


def _check_cache_salt(value: str) -> str:
    return prompt_cache_salt({"cache_salt": value})  # the engine's rule, and its message


# cache_salt (vLLM's extra field): the prefix cache shares the request's blocks only with
# requests of the same salt (one per tenant); vLLM's bounds
CacheSalt = Annotated[
    str,
    Field(
        json_schema_extra={
            "minLength": 1,
            "maxLength": MAX_CACHE_SALT_CHARS,
            "pattern": r"^[^@/\\\x00]*$",
        }
    ),
    AfterValidator(_check_cache_salt),
]


def _refuse_suffix(value: str) -> str:
    if value:
        raise ValueError("suffix (text after the insertion) is not supported, as in vLLM")
    return value


def _refuse_prompt_logprobs(value: int) -> int:
    raise ValueError(
        "prompt_logprobs is not supported: ask for echo: true with logprobs, which returns the "
        "prompt's tokens with their log-probabilities"
    )


NoSuffix = Annotated[str, Field(json_schema_extra={"maxLength": 0}), AfterValidator(_refuse_suffix)]
NoPromptLogprobs = Annotated[
    int, Field(json_schema_extra={"not": {}}), AfterValidator(_refuse_prompt_logprobs)
]

# chat_template_kwargs (vLLM's extra field: more variables for the template, such as
# enable_thinking) may not set apply_chat_template's own arguments
TemplateKwargs = Annotated[
    dict[str, Any],
    Field(json_schema_extra={"propertyNames": {"not": {"enum": sorted(TEMPLATE_ARGUMENTS)}}}),
]

# continue_final_message (vLLM's extra field: the last message stays open and the reply
# continues it, an assistant's prefill) asks for no new turn: add_generation_prompt false too
CONTINUATION_RULE = {
    "if": {
        "properties": {"continue_final_message": {"const": True}},
        "required": ["continue_final_message"],
    },
    "then": {
        "properties": {"add_generation_prompt": {"const": False}},
        "required": ["add_generation_prompt"],
    },
}

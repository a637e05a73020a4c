"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Field names and defaults follow OpenAI's API; ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``priority`` and friends are vLLM's extras. Unknown fields are
ignored, so any OpenAI client works.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from llmserve.entrypoints.openai.protocol_fields import (
    CONTINUATION_RULE,
    BestOf,
    CacheSalt,
    NoPromptLogprobs,
    NoSuffix,
    TemplateKwargs,
    TruncatePrompt,
    _integral,
)

MAX_LOGPROBS = 20  # most top logprobs per token a request may ask for
MAX_N = 64  # most completions per prompt


def _check_utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode ({e.reason} at position {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_check_utf8)]  # rejects lone surrogates ("\ud800")
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_check_utf8)]


def Int(**bounds: Any) -> Any:  # noqa: N802 - a type
    """An integer field (1.0 accepted as 1; true and "1" refused) with ``Field`` bounds."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


# A token id: an integer (true/false/1.0 refused) >= 0; the OpenAPI schema of a running server
# also states the vocabulary's end (openapi_document.openapi_schema fills in "maximum").
TokenId = Int(ge=0, json_schema_extra={"x-token-id": True})
# A token budget (generation also stops at the end of the context, so no upper bound).
MaxTokens = Int(ge=1)


# logit_bias keys: token ids written as strings (the schema's pattern is filled in likewise)
TokenIdKey = Annotated[str, Field(json_schema_extra={"x-token-id-key": True})]


class OpenAIModel(BaseModel):
    # strict: a JSON value of the wrong type is refused (no "1" for 1, no 0 for false), so the
    # server accepts exactly what its OpenAPI schema describes
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


# ---- errors ---------------------------------------------------------------------------------
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---- shared pieces ----------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk's usage so far as well


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _set(kind: str) -> dict[str, Any]:
    """JSON Schema: constraint ``kind`` is given (not null; json_object true)."""
    value = {"const": True} if kind == "json_object" else {"not": {"type": "null"}}
    return {"required": [kind], "properties": {kind: value}}


_TWO_SET = [  # no two constraints at once
    {"allOf": [_set(a), _set(b)]} for i, a in enumerate(_KINDS) for b in _KINDS[i + 1 :]
]


class StructuredOutputsField(OpenAIModel):
    """vLLM's ``structured_outputs``: exactly one of the constraints."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"anyOf": [_set(k) for k in _KINDS], "not": {"anyOf": _TWO_SET}},
    )
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class JsonSchemaFormat(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's ``response_format``: text, json_object or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel):
    """Sampling and stopping fields shared by completions and chat completions."""

    model: str | None = None
    n: Int(ge=1, le=MAX_N) = 1
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int(ge=-1) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Int(ge=-(2**63), lt=2**63) | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # unset: the model's default, or 1
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # vLLM's
    bad_words: list[Annotated[Text, Field(pattern=r"\S")]] | None = None  # vLLM's
    truncate_prompt_tokens: TruncatePrompt | None = None  # vLLM's: the prompt's last k tokens
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Int(ge=0) = 0
    priority: Int() = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's extra field
    response_format: ResponseFormat | None = None  # completions too, as vLLM's
    cache_salt: CacheSalt | None = None  # vLLM's: the prefix cache shared within one salt only
    return_token_ids: bool = False  # vLLM's: the prompt's and the choices' token ids too
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprob tokens as "token_id:N"
    stream_interval: Int(ge=1) | None = None  # vLLM's: new tokens in each streamed chunk


# ---- completions ------------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    """POST /v1/completions: ``prompt`` is text, texts, token ids or lists of token ids."""

    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: MaxTokens | None = 16
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    echo: bool = False
    best_of: BestOf | None = None
    # known fields that are not run here: refused when set, rather than ignored
    suffix: NoSuffix | None = None  # known fields not run here: refused when set
    prompt_logprobs: NoPromptLogprobs | None = None
    use_beam_search: bool = False  # vLLM's extra fields: beam search in the engine
    beam_width: Int(ge=1, le=MAX_N) | None = None  # beams (default: n), all returned
    length_penalty: float = 1.0

    model_config = ConfigDict(
        json_schema_extra={  # beam search ranks greedy log-probabilities: no sampling extras
            "if": {
                "properties": {"use_beam_search": {"const": True}},
                "required": ["use_beam_search"],
            },
            "then": {
                "properties": {
                    "stop": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
                    "logprobs": {"type": "null"},
                    "min_tokens": {"const": 0},
                    "structured_outputs": {"type": "null"},
                    "response_format": {
                        "anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]
                    },
                    "logit_bias": {"anyOf": [{"type": "null"}, {"maxProperties": 0}]},
                    "allowed_token_ids": {"type": "null"},
                    "bad_words": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
                }
            },
        }
    )

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            for text in value if isinstance(value, list) else [value]:
                if isinstance(text, str):
                    _check_utf8(text)  # the precise complaint, when that is the problem
            if value == "" or (isinstance(value, list) and ("" in value or [] in value)):
                raise ValueError("prompt is empty: give at least one character or token") from None
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids "
                "or a list of token id lists"
            ) from None


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this choice's (a chunk's: new ones)
    prompt_token_ids: list[int] | None = None  # return_token_ids (a stream's first chunk)


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- chat messages (chat completions in protocol_chat.py; tokenize takes them too) ----------
class ContentPart(OpenAIModel):
    type: Literal["text"]  # the only kind this server reads
    text: Text


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a "tool" turn: which call this answers


# ---- models, tokenizer, version ---------------------------------------------------------------
class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: give ``prompt`` (text) or ``messages`` (chat-templated)."""

    model: str | None = None
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [  # one of the two is needed
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ],
            "allOf": [CONTINUATION_RULE],
        }
    )

    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: bool = False  # vLLM's: each token's own string too (token_strs)


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class VersionResponse(OpenAIModel):
    version: str


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model (fields under their JSON names: "schema")."""
    return model.model_dump(mode="json", by_alias=True)

"""Turn a request body into ``SamplingParams``, checking what the engine cannot check alone."""

from __future__ import annotations

from typing import Any

from llmserve.entrypoints.openai.errors import OpenAIError, error_from_exception
from llmserve.entrypoints.openai.protocol import CompletionRequest, SamplingFields
from llmserve.entrypoints.openai.protocol_chat import ChatCompletionRequest
from llmserve.sampling_params import SamplingParams

_OPTIONAL_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def completion_params(
    request: CompletionRequest, vocab_size: int, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """Sampling parameters of a completion request (``echo`` + ``logprobs`` asks for prompt
    logprobs); ``defaults``: the model's, for the knobs the request leaves unset."""
    wants_prompt_logprobs = request.echo and request.logprobs is not None
    params = build_params(
        request,
        vocab_size,
        max_tokens=request.max_tokens,
        logprobs=request.logprobs,
        prompt_logprobs=request.logprobs if wants_prompt_logprobs else None,
        structured=_response_format(request),
        defaults=defaults,
    )
    if not request.use_beam_search:  # beam_width alone changes nothing
        return params
    width = request.beam_width or request.n
    try:
        return SamplingParams(
            **{**vars(params), "n": width, "temperature": 0.0, "use_beam_search": True,
               "length_penalty": request.length_penalty},
        )  # fmt: skip
    except ValueError as e:
        raise error_from_exception(e) from e


def chat_params(
    request: ChatCompletionRequest,
    vocab_size: int,
    tool_schema: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """Sampling parameters of a chat request; ``max_completion_tokens`` wins over ``max_tokens``.
    ``tool_schema``: the JSON schema a "required" / named ``tool_choice`` generates under."""
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    structured = _response_format(request)
    if tool_schema is not None:
        if structured is not None or request.structured_outputs is not None:
            raise OpenAIError(
                "tool_choice required or a named function cannot be combined with "
                "response_format or structured_outputs",
                param="tool_choice",
            )
        structured = {"json": tool_schema, "disable_any_whitespace": True}
    return build_params(
        request,
        vocab_size,
        max_tokens=max_tokens,
        logprobs=logprobs,
        structured=structured,
        defaults=defaults,
    )


def _response_format(request: SamplingFields) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as a structured-output constraint (None for text)."""
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if request.structured_outputs is not None:
        raise OpenAIError(
            "give either response_format or structured_outputs, not both",
            param="response_format",
        )
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise OpenAIError(
            'response_format of type "json_schema" needs json_schema.schema',
            param="response_format",
        )
    return {"json": fmt.json_schema.schema_}


def build_params(
    request: SamplingFields,
    vocab_size: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """Fields shared by both endpoints; a bad value is a 400 naming the field. ``defaults``
    (the model's generation_config.json, as vLLM's): what the request leaves unset."""
    defaults = defaults or {}
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    if structured is None and request.structured_outputs is not None:
        structured = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    logit_bias = _logit_bias(request.logit_bias, vocab_size)
    _check_token_ids(request.stop_token_ids or [], vocab_size, "stop_token_ids")
    _check_token_ids(request.allowed_token_ids or [], vocab_size, "allowed_token_ids")
    knobs: dict[str, Any] = {
        name: defaults[name] for name in _OPTIONAL_KNOBS if name in defaults
    } | {
        name: getattr(request, name)
        for name in _OPTIONAL_KNOBS
        if getattr(request, name) is not None
    }
    try:
        return SamplingParams(
            n=request.n,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=logit_bias,
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            max_tokens=max_tokens,
            # more than max_tokens cannot be generated: min_tokens then means "no EOS at all"
            min_tokens=min(request.min_tokens, max_tokens or request.min_tokens),
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            structured_outputs=structured,
            stream_interval=request.stream_interval,
            **knobs,
        )
    except ValueError as e:
        raise error_from_exception(e) from e


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    result = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise OpenAIError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        result[token_id] = value
    _check_token_ids(list(result), vocab_size, "logit_bias")
    return result


def _check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(
            f"{field} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
            param=field,
        )

"""schemathesis hooks for tests/test_api_contract.py (loaded through SCHEMATHESIS_HOOKS).

Some rules of the server depend on more than one field's JSON type, so no JSON Schema can
state them, and generated bodies that could break them are skipped here (each rule is tested
elsewhere):

- constraint contents (a JSON schema, regex or grammar inside structured_outputs,
  response_format or text.format) are compiled by llguidance; one that does not compile is a 400
  (tests/test_structured_output.py);
- the prompt must fit the context, and its token count depends on the tokenizer
  (tests/test_llm_api.py); a body is kept when an upper bound of its tokens fits: one token
  per UTF-8 byte of text (byte-level BPE), plus the chat template;
(max_tokens beyond the context is not a rule: generation stops at the context's end; nor is
min_tokens beyond max_tokens: it means no EOS at all.) The
server under test runs with --max-model-len MAX_MODEL_LEN; bodies asking for more than
MAX_GENERATED tokens in all are skipped too, to bound the run on two cores.
"""

import schemathesis

MAX_MODEL_LEN = 64
MAX_GENERATED = 512  # n x max_tokens per request
TEMPLATE_TOKENS = 24  # the default system prompt and role markers
PER_MESSAGE_TOKENS = 6
FREE_FORM = ("json", "regex", "grammar")


def _text_tokens(value) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")) + 1
    if isinstance(value, list):
        return sum(_text_tokens(v) if isinstance(v, str | list | dict) else 1 for v in value)
    if isinstance(value, dict):
        return sum(_text_tokens(v) for v in value.values())
    return 1


def _prompt_tokens(body: dict) -> int:
    if "input" in body:  # /v1/responses: instructions and input through the chat template
        items = body.get("input")
        items = items if isinstance(items, list) else [items]
        return (
            TEMPLATE_TOKENS
            + _text_tokens(body.get("tools") or []) * 2
            + PER_MESSAGE_TOKENS
            + _text_tokens(body.get("instructions") or "")
            + sum(PER_MESSAGE_TOKENS + _text_tokens(item) for item in items)
        )
    if "messages" in body:
        messages = body.get("messages") or []
        tools = body.get("tools")
        return (
            TEMPLATE_TOKENS
            + _text_tokens(tools or []) * 2
            + sum(PER_MESSAGE_TOKENS + _text_tokens(m) for m in messages if isinstance(m, dict))
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        return max(_text_tokens(p) for p in prompt)
    return _text_tokens(prompt)


@schemathesis.hook
def filter_body(ctx, body):
    if not isinstance(body, dict):
        return True
    structured = body.get("structured_outputs")
    if isinstance(structured, dict) and any(structured.get(k) is not None for k in FREE_FORM):
        return False
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return False
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # /v1/responses' own
        return False
    if "prompt" not in body and "messages" not in body and "input" not in body:
        return True
    prompt = _prompt_tokens(body)
    requested = (
        body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    )
    if not isinstance(requested, int):
        requested = 16 if "prompt" in body else MAX_MODEL_LEN - prompt
    if prompt >= MAX_MODEL_LEN:
        return False
    requested = min(requested, MAX_MODEL_LEN - prompt)
    n = body.get("beam_width") or body.get("n") or 1
    return not (isinstance(n, int) and n * requested > MAX_GENERATED)

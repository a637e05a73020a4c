"""Tool calling for /v1/chat/completions: tools into the prompt, tool calls out of the text.

The call format (Hermes / Qwen style; models whose chat template has no tool support are told
it in a system message):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice``:
    "none"      tools are not offered; the reply is text
    "auto"      (default with tools) the model decides; <tool_call> blocks in its text become
                ``tool_calls`` when they parse and name an offered tool, the rest is content
    "required"  the output is generated under a JSON schema of the calls (an array of one or
                more with ``parallel_tool_calls``, else one call), compact JSON, so it always
                parses and the arguments validate against the tool's parameters (only the
                declared ones unless the schema sets ``additionalProperties``)
    {"type": "function", "function": {"name": F}}   one call of F, under F's schema

With a constrained choice, a streamed reply sends each call as one tool-call delta when the
generation ends; with "auto" a streamed reply is held back until the end (it may turn out to be
a call), then sent as content or tool-call deltas.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from llmserve.entrypoints.openai.errors import OpenAIError
from llmserve.entrypoints.openai.protocol import ChatMessage, FunctionCall, ToolCall
from llmserve.entrypoints.openai.protocol_chat import ChatCompletionRequest

TOOL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

SYSTEM_PROMPT = """You can call these tools (JSON schemas of their arguments below):
{tools}
To call a tool, answer with one block per call and nothing else:
<tool_call>
{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>
Tool results come back in <tool_response> blocks. If no tool is needed, answer normally."""


def mode(request: ChatCompletionRequest) -> str:
    """ "none", "auto", "required" or "named"; a 400 for a choice that cannot be honoured."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice needs a non-empty tools list", param="tool_choice")
        return "none"
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    names = [t.function.name for t in request.tools]
    if choice.function.name not in names:
        raise OpenAIError(
            f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
            param="tool_choice",
        )
    return "named"


def _parameters(tool) -> dict[str, Any]:
    """The arguments' schema; without an ``additionalProperties`` of its own, only the declared
    parameters are generated (as OpenAI's strict mode)."""
    params = tool.function.parameters or {"type": "object", "properties": {}}
    return {"additionalProperties": False, **params}


def call_schema(request: ChatCompletionRequest, how: str) -> dict[str, Any] | None:
    """The JSON schema that "required" / "named" output is generated under (else None)."""
    if how not in ("required", "named"):
        return None
    tools = request.tools or []
    if how == "named":
        tools = [t for t in tools if t.function.name == request.tool_choice.function.name]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if how == "required" and request.parallel_tool_calls:
        return {"type": "array", "items": one, "minItems": 1}
    return one


def check_tools(request: ChatCompletionRequest) -> None:
    """Every tool's parameters must be a JSON schema of an object."""
    for tool in request.tools or []:
        params = tool.function.parameters
        if params is None:
            continue
        if params.get("type", "object") != "object":
            raise OpenAIError(
                f"tool {tool.function.name!r}: parameters must be a JSON schema of an object "
                f"(type 'object'), got type {params.get('type')!r}",
                param="tools",
            )


def conversation(
    request: ChatCompletionRequest, template_has_tools: bool, how: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the chat template, ``tools`` for it when the template takes them)."""
    messages = [message_dict(m, template_has_tools) for m in request.messages]
    if how == "none":
        return messages, None
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
    if template_has_tools:
        return messages, tools
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    prompt = SYSTEM_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def message_text(message: ChatMessage) -> str:
    """A message's content as one text (its text parts joined), as the template sees it."""
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" for part in content):
            raise OpenAIError("only text content parts are supported", param="messages")
        content = "".join(part.text or "" for part in content)
    return content or ""


def message_dict(message: ChatMessage, template_has_tools: bool) -> dict[str, Any]:
    """A message as the template wants it (text content, tool calls and results)."""
    result: dict[str, Any] = {"role": message.role, "content": message_text(message)}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls:
        if template_has_tools:
            result["tool_calls"] = [
                {"type": "function", "function": {"name": c.function.name,
                                                  "arguments": _arguments(c.function.arguments)}}
                for c in message.tool_calls
            ]  # fmt: skip
        else:
            blocks = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                )
                + "\n</tool_call>"
                for c in message.tool_calls
            ]
            result["content"] = "\n".join(filter(None, [result["content"], *blocks]))
    if message.role == "tool":
        if template_has_tools:
            if message.tool_call_id is not None:
                result["tool_call_id"] = message.tool_call_id
        else:
            result = {
                "role": "user",
                "content": f"<tool_response>\n{result['content']}\n</tool_response>",
            }
    return result


def _arguments(text: str) -> Any:
    """A past call's arguments for the template: parsed JSON, or the text as it was sent."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(
        id=f"call_{secrets.token_hex(12)}",
        function=FunctionCall(name=name, arguments=json.dumps(arguments)),
    )


def parse_constrained(text: str) -> list[ToolCall]:
    """The calls of a "required"/"named" output (JSON under ``call_schema``)."""
    value = json.loads(text)
    calls = value if isinstance(value, list) else [value]
    return [_call(c["name"], c["arguments"]) for c in calls]


def parse_auto(text: str, request: ChatCompletionRequest) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a free-form reply: <tool_call> blocks naming an offered tool."""
    names = {t.function.name for t in request.tools or []}
    calls: list[ToolCall] = []
    for block in TOOL_BLOCK.findall(text):
        try:
            value = json.loads(block)
        except ValueError:
            continue
        if isinstance(value, dict) and value.get("name") in names:
            arguments = value.get("arguments", value.get("parameters", {}))
            calls.append(_call(value["name"], arguments))
    if not calls:
        return text, []
    content = TOOL_BLOCK.sub("", text).strip()
    if not request.parallel_tool_calls:
        calls = calls[:1]
    return content or None, calls

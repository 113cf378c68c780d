"""Function calling (OpenAI ``tools`` / ``tool_choice``) through the model's chat template.

The tools reach the model the way its chat template defines (``apply_chat_template(...,
tools=...)``, transformers' tool-use convention). A template that does not take tools (no
``tools`` variable in it) gets them in the Hermes format Qwen2.5's own template writes — a
system block listing the function signatures in ``<tools></tools>`` and asking for calls as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` — with earlier calls and tool
results rendered the same way, so every chat model sees one well-known convention.

The model's answer is parsed back: each ``<tool_call>`` block (or, when the output is
constrained to calls, the whole output: one call object or a list of them) that names a
declared function and carries an ``arguments`` object becomes an OpenAI ``tool_calls`` entry
(``arguments`` as a JSON string) and the choice finishes with ``"tool_calls"``; anything
else stays text. ``tool_choice`` ``"required"`` or a named function constrains the output
with a JSON-schema grammar (:mod:`selfspec.decoding.core.grammar`), so the call is always
well-formed and its arguments follow the function's ``parameters`` schema; ``"auto"`` lets
the model choose; ``"none"`` does not show the tools.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from selfspec.serving.protocol import ApiError, check_types

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools.

    Attributes:
        tools: the OpenAI tool objects (``{"type": "function", "function": {...}}``).
        choice: ``"auto"``, ``"required"``, ``"none"``, or a function name that must be
            called.
        parallel: more than one call allowed in one answer.
    """

    tools: tuple[Mapping[str, Any], ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        """The declared functions' names."""
        return [t["function"]["name"] for t in self.tools]

    @property
    def active(self) -> bool:
        """The model sees the tools and may answer with calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The answer must be calls (``required`` or a named function)."""
        return self.active and self.choice != "auto"


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request.

    Raises:
        ApiError: 400 naming the field at fault (a tool that is not a function with a
            name, parameters that are not a JSON-schema object, a ``tool_choice`` naming an
            undeclared function, ...).
    """
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ApiError(400, "'tools' must be a non-empty list of function tools", param="tools")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(function, dict):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"parameters\": {...}}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ApiError(400, f"tools[{i}].function.name must be 1-64 letters, digits, "
                                "'_', '.' or '-'", param="tools")
        check_types(function, {"description": (str,), "strict": (bool,)},
                    f"tools[{i}].function", "tools")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param="tools")
        if name in names:
            raise ApiError(400, f"tools: the function name {name!r} is declared twice",
                           param="tools")
        names.append(name)
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise ApiError(400, "'tool_choice' must be none, auto, required or "
                                "{\"type\": \"function\", \"function\": {\"name\": one of the "
                                "declared tools}}", param="tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, "'tool_choice' must be none, auto, required or a named function",
                       param="tool_choice")
    return ToolRequest(tuple(tools), choice, parallel)


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` variable itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template


def hermes_messages(messages: Sequence[Mapping[str, Any]],
                    tools: ToolRequest | None) -> list[dict[str, Any]]:
    """``messages`` for a template that does not take tools: the tools listed in the system
    message, assistant calls as ``<tool_call>`` blocks and tool results as user turns in
    ``<tool_response>`` blocks (Hermes / Qwen2.5 format)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(
                f"{_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"])})
                + "\n</tool_call>" for c in message["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "")
                        + calls})
        elif role == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools is not None and tools.active:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
        block = ("# Tools\n\nYou may call one or more functions to assist with the user "
                 "query.\n\nYou are provided with function signatures within <tools></tools> "
                 f"XML tags:\n<tools>\n{listing}\n</tools>\n\nFor each function call, return "
                 "a json object with function name and arguments within <tool_call></tool_call>"
                 " XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}\n</tool_call>")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template that takes tools: each call's ``arguments`` as an object
    (transformers' convention), the rest as sent."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**c, "function": {"name": c["function"]["name"],
                                   "arguments": _arguments(c["function"])}}
                for c in message["tool_calls"]]
        out.append(message)
    return out


def _arguments(function: Mapping[str, Any]) -> Any:
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def call_format(tools: ToolRequest) -> dict[str, Any]:
    """The ``response_format`` that forces calls (``tool_choice`` required or named): a call
    object ``{"name": <a declared function>, "arguments": <its parameters schema>}``, or a
    list of them when parallel calls are allowed."""
    functions = [t["function"] for t in tools.tools
                 if tools.choice == "required" or t["function"]["name"] == tools.choice]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}}}
             for f in functions]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = ({"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]}
              if tools.parallel else one)
    return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema}}


@dataclass(frozen=True)
class ParsedAnswer:
    """A model answer split into text and calls.

    Attributes:
        content: the text outside the calls (``None`` when it is empty).
        calls: OpenAI ``tool_calls`` entries (``arguments`` a JSON string).
    """

    content: str | None
    calls: list[dict[str, Any]]


def parse_answer(text: str, tools: ToolRequest) -> ParsedAnswer:
    """Split ``text`` into content and tool calls (see the module docstring)."""
    names = set(tools.names)
    original = text
    found: list[Any] = []
    if tools.forced:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None  # cut by max_tokens: no call, the text stays
        if value is not None:
            found = value if isinstance(value, list) else [value]
            text = ""
    else:
        for block in _CALL.findall(text):
            try:
                found.append(json.loads(block))
            except json.JSONDecodeError:
                continue
        if found:
            text = _CALL.sub("", text)
    calls = []
    for value in found:
        if (isinstance(value, dict) and value.get("name") in names
                and isinstance(value.get("arguments", {}), dict)):
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": value["name"], "arguments": json.dumps(
                              value.get("arguments", {}), ensure_ascii=False)}})
    if not calls:
        return ParsedAnswer(original or None, [])
    if not tools.parallel:
        calls = calls[:1]
    return ParsedAnswer(text.strip() or None, calls)

"""OpenAI tools on /v1/chat/completions: the request's tools checked, put in the prompt, forced by a grammar, and
the model's tool calls parsed out of its text (docs/decisions/051-tool-calls-in-the-gateway.md).

- Prompt: a chat template that reads ``tools`` gets them (``apply_chat_template(..., tools=...)``); any other gets
  FALLBACK_PROMPT as (the head of) its system message, asking for a bare JSON object per call.
- ``tool_choice`` ``required`` or a named function: the output is constrained by ``structured_outputs.json`` to
  ``{"name": <a tool's name>, "arguments": <its parameters>}``, so the arguments always parse and fit.
- ``auto``: free text, parsed afterwards: Hermes/Qwen ``<tool_call>{...}</tool_call>`` blocks, or the whole text
  as one bare JSON call (or a list of them). A call naming no tool of the request stays content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 128  # OpenAI's own limit per request
MAX_TOOLS_BYTES = 64 * 1024  # the tools' JSON together: the engine's bound on one constraint (MAX_CONSTRAINT_BYTES)
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function-name rule (plus '.')
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
FALLBACK_PROMPT = (
    "You can call functions. To call one, reply with only a JSON object of the form "
    '{{"name": <function name>, "arguments": <object of its arguments>}} and nothing else; otherwise reply '
    "normally.\nFunctions (JSON schema of each one's arguments in \"parameters\"):\n{functions}"
)


class ToolError(ValueError):
    """A request's tools or tool_choice is not usable; the message names what is wrong."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self) -> dict:
        """``message.tool_calls[i]`` as OpenAI writes it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """``call_<24 random characters>``, as OpenAI's ids look."""
    return "call_" + secrets.token_hex(12)


def check_tools(tools: list[Any]) -> list[dict]:
    """The request's tools as ``{"type": "function", "function": {name, description?, parameters}}``; ToolError
    for a shape or size that is refused."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"{len(tools)} tools; at most {MAX_TOOLS} per request")
    if len(json.dumps(tools, ensure_ascii=False)) > MAX_TOOLS_BYTES:
        raise ToolError(f"the tools are over {MAX_TOOLS_BYTES} bytes of JSON")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.'")
        if name in names:
            raise ToolError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        entry = {"name": name, "parameters": parameters}
        if isinstance(function.get("description"), str):
            entry["description"] = function["description"]
        checked.append({"type": "function", "function": entry})
    return checked


def chosen(tool_choice: Any, tools: list[dict]) -> str | None:
    """What ``tool_choice`` asks for: "none", "auto", "required", or a tool's name; ToolError if it names none."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ToolError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) and tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolError(f"tool_choice names {name[:64]!r}, which is not among the tools", "tool_choice")
    return name


def call_schema(tools: list[dict], choice: str) -> dict:
    """The JSON schema a forced call's output must fit: one tool's (a named choice) or any tool's (required)."""
    def one(tool: dict) -> dict:
        function = tool["function"]
        return {"type": "object", "properties": {"name": {"const": function["name"]},
                                                 "arguments": function["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}

    if choice != "required":
        return one(next(t for t in tools if t["function"]["name"] == choice))
    options = [one(t) for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def fallback_system_prompt(tools: list[dict]) -> str:
    """The system text that lists the functions for a template that does not read ``tools``."""
    return FALLBACK_PROMPT.format(functions="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))


def template_messages(messages: list[dict], tools: list[dict] | None, template_reads_tools: bool) -> list[dict]:
    """The messages as the template should get them. With a template that reads tools: assistant calls' arguments
    as objects (as Hugging Face templates expect). Otherwise: the fallback prompt in the system message, assistant
    calls written as the JSON the prompt asks for, and tool results as user messages."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            if template_reads_tools:
                message["tool_calls"] = [_with_object_arguments(c) for c in calls]
            else:
                message.pop("tool_calls")
                written = [_call_text(c) for c in calls]
                message["content"] = "\n".join(filter(None, [message.get("content") or "", *written]))
        if message.get("role") == "tool" and not template_reads_tools:
            ref = message.pop("tool_call_id", None) or message.pop("name", None) or "a call"
            message = {"role": "user", "content": f"Result of {ref}: {message.get('content') or ''}"}
        out.append(message)
    if tools and not template_reads_tools:
        prompt = fallback_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": prompt + "\n\n" + (out[0].get("content") or "")}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _with_object_arguments(call: Any) -> Any:
    """An assistant call with its arguments string parsed (left alone when it is not a JSON object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _call_text(call: Any) -> str:
    function = _with_object_arguments(call).get("function", {}) if isinstance(call, dict) else {}
    return json.dumps({"name": function.get("name"), "arguments": function.get("arguments", {})}, ensure_ascii=False)


# ---- parsing ---------------------------------------------------------------------------------------------

def _as_call(value: Any, names: set[str]) -> ToolCall | None:
    """A ``{"name", "arguments" | "parameters"}`` object naming one of ``names`` as a ToolCall."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def hermes_blocks(text: str) -> list[tuple[int, int, str]]:
    """(start, end, stripped inside) of each ``<tool_call>...</tool_call>`` block (an unclosed last one runs to the
    end): one left-to-right pass of ``str.find``."""
    blocks, at = [], text.find(OPEN_TAG)
    while at >= 0:
        inner = at + len(OPEN_TAG)
        close = text.find(CLOSE_TAG, inner)
        end = close + len(CLOSE_TAG) if close >= 0 else len(text)
        blocks.append((at, end, text[inner:close if close >= 0 else len(text)].strip()))
        at = text.find(OPEN_TAG, end)
    return blocks


def parse_tool_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a model's output: Hermes ``<tool_call>`` blocks (an unclosed last one too), else the
    whole text as one bare JSON call or a list of them. Text that is no call stays content."""
    if OPEN_TAG in text:
        calls, kept, last = [], [], 0
        for start, end, inner in hermes_blocks(text):
            call = _as_call(_json(inner), names)
            if call is None:
                continue
            kept.append(text[last:start])
            last = end
            calls.append(call)
        if calls:
            kept.append(text[last:])
            return "".join(kept).strip(), calls
        return text, []
    value = _json(text.strip()) if text.strip()[:1] in ("{", "[") else None
    items = value if isinstance(value, list) and value else [value]
    calls = [_as_call(item, names) for item in items]
    if value is not None and all(calls):
        return "", calls
    return text, []


def forced_call(text: str, names: set[str]) -> ToolCall | None:
    """The call of a grammar-forced output (None when it did not end: cut by max_tokens)."""
    return _as_call(_json(text), names)


@dataclass(slots=True)
class Holding:
    """held_back's rule over an output that grows piece by piece: each ``add`` costs O(len(piece))."""

    size: int = 0
    lead: str = ""  # the output's first non-space character ("" while there is none)
    tag_at: int = -1  # where its first <tool_call> starts (-1: none yet)
    tail: str = ""  # its last len(OPEN_TAG) - 1 characters (a tag may straddle two pieces)

    def add(self, piece: str) -> int:
        """Absorb ``piece``; how many characters at the end of the output so far must be held back."""
        if not self.lead:
            self.lead = piece.lstrip()[:1]
        if self.tag_at < 0:
            window = self.tail + piece
            at = window.find(OPEN_TAG)
            if at >= 0:
                self.tag_at = self.size - len(self.tail) + at
            self.tail = window[-(len(OPEN_TAG) - 1):]
        self.size += len(piece)
        if self.lead in ("", "{", "["):
            return self.size
        if self.tag_at >= 0:
            return self.size - self.tag_at
        for k in range(min(len(OPEN_TAG) - 1, len(self.tail)), 0, -1):
            if self.tail.endswith(OPEN_TAG[:k]):
                return k
        return 0


def held_back(text: str) -> int:
    """How much of ``text``'s end a stream of ``auto`` output must hold: from the first ``<tool_call>`` (or a
    prefix of it at the end) on, or all of it while it may be one bare JSON call (it starts with '{' or '[')."""
    return Holding().add(text)

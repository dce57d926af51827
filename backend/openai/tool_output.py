"""A chat choice's text as OpenAI's tool-call output: ``message.tool_calls`` and ``delta.tool_calls``.

Streamed, content passes as it comes until it may be a call (tools.held_back); the calls themselves are sent
when the choice ends, one ``delta.tool_calls`` entry per call holding its index, id, type, name and the whole
arguments string (OpenAI's SDKs accumulate that as they do OpenAI's pieces). A choice that returned calls ends
with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.openai.tools import OPEN_TAG, ToolCall, forced_call, held_back, parse_tool_calls


@dataclass
class ToolOutput:
    """Tool-call parsing for one request: ``choice`` is "auto" or forced ("required" or a tool's name)."""

    choice: str
    names: set[str]
    texts: dict[int, str] = field(default_factory=dict)  # streamed: each choice's text so far
    sent: dict[int, int] = field(default_factory=dict)  # streamed: characters of it sent as content

    def parse(self, text: str, emitted: int = 0) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a choice's text past its first ``emitted`` characters (those went out as content)."""
        if self.choice != "auto":
            call = forced_call(text, self.names)
            return ("", [call]) if call is not None else (text, [])
        tail = text[emitted:]
        if emitted and OPEN_TAG not in tail:  # a bare JSON call is the whole text or nothing
            return tail, []
        return parse_tool_calls(tail, self.names)

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The non-streamed ``message`` and finish reason of a choice that produced ``text``."""
        content, calls = self.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return ({"role": "assistant", "content": content or None, "tool_calls": [c.as_openai() for c in calls]},
                "tool_calls")

    def stream(self, index: int, text: str, finish: str | None) -> list[tuple[dict, str | None]]:
        """The chunk deltas (with their finish reasons) for ``text`` just added to choice ``index``."""
        so_far = self.texts[index] = self.texts.get(index, "") + text
        sent = self.sent.get(index, 0)
        if finish is None:
            ready = len(so_far) - (len(so_far) if self.choice != "auto" else held_back(so_far))
            if ready <= sent:
                return []
            self.sent[index] = ready
            return [({"content": so_far[sent:ready]}, None)]
        content, calls = self.parse(so_far, sent)
        if not calls:
            rest = so_far[sent:]
            return [({"content": rest} if rest else {}, finish)]
        out = [({"content": content}, None)] if content else []
        out.append(({"tool_calls": [{"index": i, **call.as_openai()} for i, call in enumerate(calls)]},
                    "tool_calls"))
        return out
